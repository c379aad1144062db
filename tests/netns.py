"""Two "hosts" on one machine: network namespaces joined by a training link, each with a decoy too.

    host-a (netns)                          host-b (netns)
      trn0 10.123.0.1/24  <-- veth pair -->   trn0 10.123.0.2/24    the link training must use
      eth0 10.124.0.1/24  <-- veth pair -->   eth0 10.124.0.2/24    a decoy named like a default NIC

Interface names are per namespace, so both hosts have the same `trn0` and `eth0`, as real nodes would.
Commands run inside with their own UTS namespace, so each host also has its own host name. Only the
namespaces made here are addressed, and `down()` deletes them (and with them every link), also after
a failed test.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from dataclasses import dataclass

TRAIN_NET, DECOY_NET = "10.123.0", "10.124.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"taprobe{uuid.uuid4().hex[:6]}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    ns: str
    hostname: str
    train_ip: str
    decoy_ip: str

    def prefix(self) -> list[str]:
        """Run a command on this host: its network namespace and its own host name."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname]

    def bytes(self, dev: str) -> int:
        """Bytes received plus sent on `dev` so far."""
        link = json.loads(_ip("-n", self.ns, "-s", "-j", "link", "show", "dev", dev).stdout)[0]
        stats = link["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]


class TwoHosts:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        self.a = Host(f"trainapp-{tag}-a", "host-a", f"{TRAIN_NET}.1", f"{DECOY_NET}.1")
        self.b = Host(f"trainapp-{tag}-b", "host-b", f"{TRAIN_NET}.2", f"{DECOY_NET}.2")
        self.made: list[str] = []

    def _pair(self, kind: str, name: str) -> None:
        """A veth pair between the two hosts, called `name` on both sides."""
        left, right = f"{kind}a{self.tag}", f"{kind}b{self.tag}"  # unique in the root namespace
        _ip("link", "add", left, "type", "veth", "peer", "name", right)
        for dev, host in ((left, self.a), (right, self.b)):
            _ip("link", "set", dev, "netns", host.ns)
            _ip("-n", host.ns, "link", "set", dev, "name", name)

    def up(self) -> "TwoHosts":
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.ns)
                self.made.append(host.ns)
                # No IPv6 chatter (router solicitations) on the links: byte counters then show training only.
                subprocess.run(["ip", "netns", "exec", host.ns, "sysctl", "-q", "-w",
                                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                               check=True, capture_output=True, timeout=30)
            self._pair("t", "trn0")
            self._pair("d", "eth0")
            for host in (self.a, self.b):
                _ip("-n", host.ns, "addr", "add", f"{host.train_ip}/24", "dev", "trn0")
                _ip("-n", host.ns, "addr", "add", f"{host.decoy_ip}/24", "dev", "eth0")
                for dev in ("lo", "trn0", "eth0"):
                    _ip("-n", host.ns, "link", "set", dev, "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for ns in self.made:
            _ip("netns", "del", ns, check=False)  # takes its links (and their peers) with it
        self.made = []
