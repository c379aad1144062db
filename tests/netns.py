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

import contextlib
import json
import os
import signal
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

    def prefix(self, memory: str = "") -> list[str]:
        """Run a command on this host: its network namespace and its own host name; with `memory` (a tmpfs
        size such as 256m), its own /dev/shm too, in a mount namespace of the command's: the host's memory,
        gone with the last of the command's processes, as a lost node's is (and an /etc/hosts that names
        both hosts, which torchrun's c10d rendezvous resolves)."""
        if not memory:
            return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                    'hostname "$0" && exec "$@"', self.hostname]
        names = f"127.0.0.1 localhost\n{TRAIN_NET}.1 host-a\n{TRAIN_NET}.2 host-b\n"
        setup = (f'hostname "$0" && mount -t tmpfs -o size={memory} tmpfs /dev/shm && '
                 f"printf '{names}' > /dev/shm/.hosts && mount --bind /dev/shm/.hosts /etc/hosts && "
                 'exec "$@"')
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup, self.hostname]

    def kill_all(self) -> int:
        """SIGKILL every process on this host (in its network namespace), as a lost node: how many."""
        pids = [int(p) for p in _ip("netns", "pids", self.ns, check=False).stdout.split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

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


STAR_NET = "10.125.0"


class Star:
    """N hosts on one switch: each host's `trn0` (10.125.0.1, .2, ...) is a veth whose other end is a
    port of a bridge in a namespace of its own, as nodes on one top-of-rack switch. `shape(i, rate)`
    limits host i's link in both directions with a real `tbf` qdisc (on the host's side and on its
    switch port). Only these namespaces are addressed; `down()` deletes them and their links."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        self.switch = f"trainapp-{tag}-sw"
        self.hosts = [Host(f"trainapp-{tag}-{i}", f"host-{chr(ord('a') + i)}", f"{STAR_NET}.{i + 1}", "")
                      for i in range(n)]
        self.made: list[str] = []

    def up(self) -> "Star":
        try:
            for ns in (self.switch, *(h.ns for h in self.hosts)):
                _ip("netns", "add", ns)
                self.made.append(ns)
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                                "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                               check=True, capture_output=True, timeout=30)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                left, right = f"s{i}a{self.tag}", f"s{i}b{self.tag}"  # unique in the root namespace
                _ip("link", "add", left, "type", "veth", "peer", "name", right)
                _ip("link", "set", left, "netns", host.ns)
                _ip("-n", host.ns, "link", "set", left, "name", "trn0")
                _ip("link", "set", right, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", right, "name", f"port{i}")
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"port{i}", "up")
                _ip("-n", host.ns, "addr", "add", f"{host.train_ip}/24", "dev", "trn0")
                for dev in ("lo", "trn0"):
                    _ip("-n", host.ns, "link", "set", dev, "up")
        except BaseException:
            self.down()
            raise
        return self

    def shape(self, i: int, rate: str) -> None:
        """Limit host i's link to `rate` (tc syntax, e.g. 100mbit) both ways."""
        for ns, dev in ((self.hosts[i].ns, "trn0"), (self.switch, f"port{i}")):
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", "32kb", "latency", "100ms"],
                           check=True, capture_output=True, text=True, timeout=30)

    def down(self) -> None:
        for ns in self.made:
            _ip("netns", "del", ns, check=False)
        self.made = []
