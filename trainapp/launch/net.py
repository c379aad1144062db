"""Which network interface NCCL and Gloo use, decided on purpose on every node.

Left alone, Gloo binds to whatever the host name resolves to and NCCL to the first interface it
likes; on a multi-homed node (Kubernetes pods, docker0, a second NIC) that is often an address the
peers cannot reach, and the first collective hangs until the process-group timeout. Here each node
resolves `network.interface` itself, checks it, exports NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME before
the process group exists, and says what it chose and why.

Interfaces and addresses come from psutil. The route to the rendezvous address is the kernel's: a
UDP socket `connect` picks the source address without sending a packet.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass, field

from trainapp.config import ConfigError, NetworkSection

log = logging.getLogger(__name__)

NCCL_IFNAME, GLOO_IFNAME = "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"

NETWORK_ENV = "TRAINAPP_NETWORK"
"""Where `apply` leaves its choice (JSON) for the rest of the process: under Ray the interface is
resolved in a hook before Ray creates the process group, and the loop reads it back from here."""

EXPORTED_ENV = "TRAINAPP_NETWORK_EXPORTED"
"""What `apply` exported itself (JSON), kept in the environment it exported to, so a second resolution
in the same process (Ray reuses nothing, tests do) does not mistake trainapp's own value for the
user's."""


class NetworkError(ConfigError):
    """This node cannot use the requested interface: one line naming host, request and what it has."""


@dataclass(frozen=True)
class Interface:
    name: str
    ipv4: tuple[str, ...]
    up: bool

    def describe(self) -> str:
        state = "" if self.up else " down"
        return f"{self.name} {','.join(self.ipv4) if self.ipv4 else 'no-IPv4'}{state}"


def interfaces() -> dict[str, Interface]:
    """Every interface of this host with its IPv4 addresses, in the kernel's order."""
    import psutil

    stats = psutil.net_if_stats()
    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        ipv4 = tuple(a.address for a in addrs if a.family == socket.AF_INET)
        out[name] = Interface(name, ipv4, bool(stats.get(name) and stats[name].isup))
    return out


def describe_all(ifaces: dict[str, Interface]) -> str:
    return ", ".join(i.describe() for i in ifaces.values()) or "none"


def source_address(host: str) -> str | None:
    """The local IPv4 address the kernel would use to reach `host` (None: no route, or no such host)."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # a UDP connect only selects the route; nothing is sent
            return s.getsockname()[0]
        except OSError:
            return None


@dataclass
class Resolution:
    """One node's choice. `nccl`/`gloo` are the values for the two variables (None: not set)."""

    host: str
    request: str
    rendezvous: str | None
    nccl: str | None
    gloo: str | None
    address: str | None
    reason: str
    exported: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Resolution | None:
        """The choice `apply` made earlier in this process, if it made one."""
        raw = environ.get(NETWORK_ENV)
        return cls(**json.loads(raw)) if raw else None

    def summary(self) -> str:
        chosen = f"gloo={self.gloo} ({self.address}) nccl={self.nccl}" if self.gloo else "no interface set"
        kept = "".join(f"; {k}={v} from the environment wins" for k, v in self.kept.items())
        return f"host {self.host}: {chosen}: {self.reason}{kept}"


def _fail(request: str, host: str, what: str, ifaces: dict[str, Interface]) -> NetworkError:
    return NetworkError(f"network.interface={request}: host {host} {what} (it has: {describe_all(ifaces)}); "
                        "name one of those, or use auto")


def _check_named(request: str, host: str, names: list[str], ifaces: dict[str, Interface]) -> None:
    """NetworkError unless every named interface exists here, up, with an IPv4 address."""
    for n in names:
        if n not in ifaces:
            raise _fail(request, host, f"has no interface {n}", ifaces)
        if not (ifaces[n].ipv4 and ifaces[n].up):
            raise _fail(request, host, f"has interface {n} but it has no IPv4 address or is down", ifaces)


def resolve(request: str, rendezvous: str | None, ifaces: dict[str, Interface] | None = None,
            host: str | None = None) -> Resolution:
    """Resolve `network.interface` on this node; NetworkError when it cannot be honoured here."""
    host = host or socket.gethostname()
    ifaces = interfaces() if ifaces is None else ifaces
    usable = {n: i for n, i in ifaces.items() if i.ipv4 and i.up}
    route_ip = source_address(rendezvous) if rendezvous else None
    route_if = next((n for n, i in usable.items() if route_ip in i.ipv4), None) if route_ip else None
    to = f"the route to {rendezvous}"

    def chosen(nccl: str, gloo: str, reason: str) -> Resolution:
        return Resolution(host, request, rendezvous, nccl, gloo, usable[gloo].ipv4[0], reason)

    if request == "auto":
        if not rendezvous:
            return Resolution(host, request, None, None, None, None,
                              "auto: no rendezvous address (a single process): nothing to choose")
        if route_if is None:
            raise _fail(request, host, f"has no interface on {to} (source address {route_ip or 'none'})",
                        ifaces)
        return chosen(route_if, route_if, f"auto: {route_if} carries {to}")

    if request.startswith("^"):
        excluded = [n.strip() for n in request[1:].split(",")]
        allowed = [n for n in usable if n not in excluded]
        if not allowed:
            raise _fail(request, host, "has no interface with an IPv4 address outside the exclusion", ifaces)
        if route_if in allowed:
            gloo, why = route_if, f"it carries {to}"
        else:
            # Prefer a real NIC over loopback when the route does not decide it.
            gloo = next((n for n in allowed if not usable[n].ipv4[0].startswith("127.")), allowed[0])
            why = f"the first allowed; {to} uses {route_if}" if route_if else "the first allowed"
        return chosen(request, gloo, f"all but {','.join(excluded)}; Gloo uses {gloo} ({why})")

    names = [n.strip() for n in request.split(",")]
    _check_named(request, host, names, ifaces)
    gloo = route_if if route_if in names else names[0]
    why = f"it carries {to}" if gloo == route_if else (f"{to} uses {route_if or 'none of them'}" if rendezvous
                                                      else "the first named")
    # `=` makes NCCL match the names exactly (its default is a prefix match: `eth` would take eth10).
    return chosen("=" + ",".join(names), gloo, f"named; Gloo uses {gloo} ({why})")


def apply(section: NetworkSection, rendezvous: str | None, environ: MutableMapping[str, str] = os.environ,
          host: str | None = None) -> Resolution:
    """Resolve, then export the variables (and `network.nccl`) unless the environment already has them;
    the choice itself goes to TRAINAPP_NETWORK for `Resolution.from_environ`. `host`: this node's name
    in messages (default: the host name)."""
    host = host or socket.gethostname()
    env_gloo = environ.get(GLOO_IFNAME)
    ours = json.loads(environ.get(EXPORTED_ENV, "{}"))
    if env_gloo and ours.get(GLOO_IFNAME) != env_gloo:
        # The user's own Gloo interface still has to exist here, or Gloo fails late and obscurely.
        ifaces = interfaces()
        if env_gloo not in ifaces or not ifaces[env_gloo].ipv4:
            raise NetworkError(f"environment {GLOO_IFNAME}={env_gloo}: host {host} has no such "
                               f"interface with an IPv4 address (it has: {describe_all(ifaces)}); unset it "
                               "or name one of those")
    res = resolve(section.interface, rendezvous, host=host)
    wanted = {NCCL_IFNAME: res.nccl, GLOO_IFNAME: res.gloo, **section.nccl}
    for key, value in wanted.items():
        if value is None:
            continue
        if key in environ and environ[key] != ours.get(key) and environ[key] != value:
            res.kept[key] = environ[key]
            log.warning("%s=%s from the environment wins over the configured %s", key, environ[key], value)
            continue
        environ[key] = ours[key] = res.exported[key] = str(value)
    environ[EXPORTED_ENV] = json.dumps(ours)
    environ[NETWORK_ENV] = json.dumps(res.to_dict())
    log.info("network: %s", res.summary())
    return res


def check_hosts(reports: list[dict]) -> None:
    """Every rank's choice ({"host", "request", "address", "rendezvous"} by rank): NetworkError when
    `auto` chose loopback on a rank of a group that spans several hosts. A node whose host name
    resolves to 127.0.1.1 (Debian's /etc/hosts) and is the rendezvous (MASTER_ADDR=$(hostname)) routes
    it over `lo`: NCCL and Gloo would listen there, and the other nodes could never connect."""
    hosts = {r.get("host") for r in reports}
    if len(hosts) < 2:
        return
    for rank, r in enumerate(reports):
        if r.get("request") == "auto" and str(r.get("address") or "").startswith("127."):
            raise NetworkError(f"network.interface=auto: rank {rank} on host {r['host']} reaches the "
                               f"rendezvous {r.get('rendezvous')} over loopback ({r['address']}) while the "
                               f"ranks run on {len(hosts)} hosts; set MASTER_ADDR to an address the other "
                               "nodes reach (not a name that resolves to 127.x here) or name the interface "
                               "(network.interface=eth0)")


def rendezvous_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The torchrun / env:// rendezvous host (MASTER_ADDR), if any."""
    return environ.get("MASTER_ADDR") or None


def ray_head_host() -> str | None:
    """The Ray head's address as this worker sees it (the GCS address's host)."""
    import ray

    address = ray.get_runtime_context().gcs_address or ""
    return address.rpartition(":")[0] or None
