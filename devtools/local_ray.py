"""A real multi-node Ray cluster on one machine, for development, demos and tests.

A head with no task CPUs and N worker nodes, each its own `ray start` with its own resources, all on
loopback. Each node has an address of its own: the head 127.0.0.2, the workers 127.0.0.3, .4, ...
(Ray rewrites 127.0.0.1 and `localhost` into the machine's external address, "remotely reachable",
while any other 127/8 address is kept, and Linux routes all of 127/8 to loopback). Ray Train places
workers by node address, so the workers get `node_rank` 0, 1, ... and `local_rank` 0 on each, as on
separate machines, not ranks of one machine. Each node also has its own temp directory, so its log
monitor streams its own workers' logs only (with one shared directory every node streamed every
worker's, and a job's output showed each line once per node). The dashboard (job submission) listens
on 127.0.0.1. Token authentication is on: a
fresh token in a file under the cluster's directory (outside the repository), handed to every node
and to `ray job submit` through RAY_AUTH_TOKEN_PATH. The nodes also get their own HOME, so a stale
`~/.ray/auth_token` from another Ray instance cannot leak in.

Every node runs `ray start --block` as the leader of its own session; `down` ends exactly those
sessions (SIGTERM, then SIGKILL for stragglers), never other Ray processes on the machine.

    python -m devtools.local_ray up --workers 2 --cpus 1
    python -m devtools.local_ray submit -- python -m trainapp ray ray.storage_path=$PWD/runs/ray
    python -m devtools.local_ray status
    python -m devtools.local_ray down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AbstractSet, Any

from trainapp.launch.ray import spares
from trainapp.launch.ray.stop import STOP_WAIT_S

DEFAULT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / f"trainapp-ray-{os.getuid()}"
STATE = "cluster.json"
RAY = str(Path(sys.executable).with_name("ray"))
"""The `ray` CLI of the Python running this (the venv's): nodes and jobs use the same Ray as trainapp."""


def proc_stat(pid: int, tid: int | None = None) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of /proc/PID/stat, or of its thread TID's: state is [0], ppid [1],
    session [3], utime and stime (clock ticks) [11] and [12], nice [16]. None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat").read_text()
    except OSError:
        return None
    end = stat.rindex(")")  # comm may itself contain ") "
    return stat[stat.index("(") + 1:end], stat[end + 2:].split()


def _session_pids(*sids: int) -> list[int]:
    """PIDs of every live process in the sessions `sids` (Ray's children stay in their `ray start`'s
    session)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := proc_stat(int(d.name))) and int(st[1][3]) in sids and st[1][0] != "Z":
            pids.append(int(d.name))
    return pids


def _kill_sessions(*sids: int) -> None:
    """SIGKILL every live process in the sessions `sids`."""
    for pid in _session_pids(*sids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _session_nice(pid: int, nice: int) -> None:
    """Give the session `pid` leads (`ray start` and every process it starts) the nice value `nice`
    as a whole. Where the kernel groups processes by session (autogroup scheduling,
    /proc/sys/kernel/sched_autogroup_enabled: on in most desktop kernels and on this project's CI
    machines), it first shares the CPU between sessions, and a process's own nice value ranks it only
    inside its session: the head at nice 10 would still take a full share beside each worker node's
    session. Without autogroups the file is missing and the processes' own nice values do the work: every
    thread of the session's live processes is set (a nice value is each thread's own), and what they
    start later inherits it."""
    for member in _session_pids(pid):
        for task in Path(f"/proc/{member}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int, taken: AbstractSet[int] = frozenset()) -> list[int]:
    """`n` distinct free ports, none of `taken`: all bound at once, since a port just released can be
    handed out again (Ray refuses a node whose components were given the same port)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in taken:
                ports.append(s.getsockname()[1])
        return ports


def _own_ports(metrics_port: int, agent_http: int, agent_grpc: int, runtime_env: int) -> list[str]:
    """Per-node ports for what Ray otherwise puts on fixed defaults (52365, 10001, 8080, ...), so that
    several nodes, and several such clusters, share one machine."""
    return [f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics_port}", f"--runtime-env-agent-port={runtime_env}"]


def _wait_port(port: int, timeout: float, host: str = "127.0.0.1") -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            time.sleep(0.3)
    return False


@dataclass
class Node:
    name: str
    pid: int  # the `ray start --block` session leader
    log: str
    metrics_port: int = 0
    """Where the node's Ray metrics agent serves Prometheus' format (with `LocalCluster.metrics`)."""
    ip: str = ""
    """The loopback address the node serves on (`--node-ip-address`): Ray names the node by it."""


class StartExited(RuntimeError):
    """A node's `ray start` exited before the node joined the cluster."""


@dataclass
class LocalCluster:
    dir: Path = DEFAULT_DIR
    workers: int = 2
    cpus: float = 1
    node_ip: str = "127.0.0.2"
    """The head's address; worker node i (from 1) gets the next ones, 127.0.0.(2+i)."""
    gcs_port: int = 26379
    dashboard_port: int = 28265
    # Node-death detection (GCS health checks of each raylet). Ray's defaults: 3000 ms x 5 misses.
    # The period only spaces out the checks after a failed one: a busy raylet has
    # health_check_timeout_ms (10 s) to answer each. On loopback a check fails at once only when the
    # raylet is gone, so the local cluster checks twice as often as the real-cluster configs, whose
    # checks cross a network (docs/ray.md, "Recovery knobs").
    health_check_period_ms: int = 500
    health_check_failure_threshold: int = 3
    # Ray's per-process metrics export (for Prometheus/Grafana). Off by default here: on a laptop
    # nothing scrapes it, and its agents and exporters cost more CPU than the training difference
    # between launchers (see docs/ray.md, "A lean local cluster").
    metrics: bool = False
    # The head's processes (GCS, dashboard, job driver, Train controller and helper actors) run at this
    # nice value, and so does their session as a whole (`_session_nice`): on one machine they share the
    # cores with training, where a real head has a machine of its own.
    head_nice: int = 10
    # Nice value of the worker processes (training) the raylets start. Ray's default: 15.
    worker_nice: int = 0
    # A memory of its own for each worker node, as separate machines have: its `ray start` runs in a mount
    # namespace of its own with a fresh tmpfs of this size (e.g. "512m") on /dev/shm, gone with the node's
    # last process (the memory tier's copies of a lost node are lost with it). Needs root. Empty: every
    # node shares this machine's /dev/shm.
    node_memory: str = ""
    nodes: list[Node] = field(default_factory=list)

    # -- paths and environment ------------------------------------------------------------------

    @property
    def token_path(self) -> Path:
        return self.dir / "auth_token"

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self) -> dict[str, str]:
        """Environment for every node, for `ray job submit` and for clients of this cluster."""
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "HOME": str(self.dir / "home"),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Each node's log monitor globs the session's log folder 10 times a second to find new
            # worker logs; every 2 s is enough to stream them, and the scan is a steady cost on every node.
            "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
            "LOG_NAME_UPDATE_INTERVAL_S": "2",
            # With the export on, figures reach it every 2 s (Ray's default: 10 s): a local cluster's
            # runs are short, and a person watching one wants the step to move between two looks.
            **({"RAY_metrics_report_interval_ms": "2000"} if self.metrics
               else {"RAY_enable_metrics_collection": "false"}),
            # A daemon gives the GCS 5 s to answer its first call, then exits (the dashboard: "Failed to
            # connect to GCS ... within 5 seconds", and the head never comes up); a busy 2-core machine can
            # take longer.
            "RAY_gcs_rpc_server_connect_timeout_s": "30",
            # The dashboard's modules are processes that must be up within 30 s, or the head fails to start
            # ("Module MetricsHead failed to start"): seen with a second test suite beside this one's cluster.
            "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT": "120",
            # Raylets start worker processes at nice 15 by default, below every Ray daemon on the
            # node; training then yields the cores to the cluster's own housekeeping.
            "RAY_worker_niceness": str(self.worker_nice),
            # Jobs run `python -m trainapp ...` through the head's shell: our venv must come first.
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        }

    def client_env(self) -> dict[str, str]:
        """What a process outside the cluster (this test, a shell) needs to talk to it."""
        return {k: self.env()[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}

    # -- lifecycle ------------------------------------------------------------------------------

    def _start(self, name: str, args: list[str], cwd: Path) -> Node:
        log = self.dir / "logs" / f"{name}.log"
        ip = self.node_ip if not self.nodes else self._address_of(len(self.nodes))
        # A short per-node temp directory: Ray's socket paths under it must stay under 108 bytes.
        temp = self.dir / ("r" if not self.nodes else f"n{len(self.nodes)}")
        # Not the ports this node's arguments (the head's GCS, dashboard, client) or the cluster already name.
        named = {int(a.rsplit("=", 1)[1]) for a in args if a.startswith("--")
                 and a.split("=")[0].endswith("-port") and a.rsplit("=", 1)[1].isdigit()}
        ports = free_ports(4, named | {self.gcs_port, self.dashboard_port}
                           | {n.metrics_port for n in self.nodes})
        cmd = [RAY, "start", "--block", f"--node-ip-address={ip}", f"--temp-dir={temp}",
               "--disable-usage-stats", *_own_ports(*ports), *args]
        if self.node_memory and "--head" not in args:
            # unshare and sh exec in place: the session leader's PID stays the node's.
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f'mount -t tmpfs -o size={self.node_memory} tmpfs /dev/shm && exec "$@"', "sh", *cmd]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd,
                                    env=self.env(), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        node = Node(name, proc.pid, str(log), ports[0], ip)
        self.nodes.append(node)
        self._save()
        return node

    def up(self, timeout: float = 120, cwd: Path | None = None) -> "LocalCluster":
        if (self.dir / STATE).exists():
            raise SystemExit(f"local ray cluster: a cluster is already recorded in {self.dir / STATE}; "
                             "run `make ray-down` (or `python -m devtools.local_ray down`) first")
        for host, port in ((self.node_ip, self.gcs_port), ("127.0.0.1", self.dashboard_port)):
            if _wait_port(port, 0.2, host):
                raise SystemExit(f"local ray cluster: port {port} on 127.0.0.1 is in use; pick others "
                                 "(RAY_PORT / RAY_DASHBOARD_PORT)")
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "home").mkdir(exist_ok=True)
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        cwd = cwd or Path.cwd()
        system_config = json.dumps({"health_check_period_ms": self.health_check_period_ms,
                                    "health_check_failure_threshold": self.health_check_failure_threshold})
        try:
            self._start("head", ["--head", "--num-cpus=0", f"--port={self.gcs_port}",
                                 "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={self.dashboard_port}", "--include-dashboard=true",
                                 f"--ray-client-server-port={free_port()}",
                                 f"--system-config={system_config}"], cwd)
            if (not _wait_port(self.gcs_port, timeout, self.node_ip)
                    or not _wait_port(self.dashboard_port, timeout)):
                raise RuntimeError(f"head did not come up; see {self.nodes[0].log}")
            # One at a time: on a small machine several raylets starting at once can miss their
            # registration deadline ("The current node timed out during startup").
            self.wait_for_nodes(1, timeout, started=self.nodes[0])
            for i in range(self.workers):
                self.join_worker(f"worker{i + 1}", 2 + i, timeout, cwd)
            self.wait_for_jobs(timeout)
            # The head yields to training only once the cluster is up: at nice 10 from its start, a busy
            # machine (two suites side by side) starved its raylet past Ray's fixed 30 s registration
            # deadline. Its later children (job supervisors) inherit the lower priority.
            _session_nice(self.nodes[0].pid, self.head_nice)
        except BaseException:
            self.down()
            raise
        return self

    def _address_of(self, index: int) -> str:
        """The loopback address of the node started `index`-th (0: the head)."""
        head = self.node_ip.split(".")
        return ".".join([*head[:3], str(int(head[3]) + index)])

    def add_worker(self, name: str, cwd: Path | None = None) -> Node:
        """Start one more worker node (e.g. to replace a lost one)."""
        return self._start(name, [f"--address={self.address}", f"--num-cpus={self.cpus:g}"],
                           cwd or Path.cwd())

    def join_worker(self, name: str, count: int, timeout: float = 120, cwd: Path | None = None) -> Node:
        """Start one more worker node and wait until `count` nodes are alive. Ray gives a new raylet a
        fixed 30 s to register with the GCS, which a loaded machine can pass (the head's GCS yields to
        training at `head_nice`): a `ray start` that exits before its node joined is started again while
        `timeout` leaves room for another 30 s. The one way a worker node joins: `up` and the tests that
        replace a lost node."""
        deadline, attempt = time.monotonic() + timeout, 0
        while True:
            node = self.add_worker(name if attempt == 0 else f"{name}-again{attempt}", cwd)
            try:
                self.wait_for_nodes(count, max(deadline - time.monotonic(), 1), started=node)
                return node
            except StartExited:
                attempt += 1
                if deadline - time.monotonic() < 40:
                    raise

    def heal(self, timeout: float = 180, cwd: Path | None = None) -> list[str]:
        """Replace every worker node whose raylet is gone (a test killed it and failed before it joined
        another), so the cluster has `workers` again: the names of the nodes started. What was left of a
        lost node's session is killed first. A test that failed mid-way then costs the tests after it
        nothing; without this, each of them waited out its bound for a worker that never came."""
        lost = [n for n in self.nodes[1:] if "raylet" not in self.node_pids(n.name)]
        _kill_sessions(*(n.pid for n in lost))
        alive = len(self.nodes) - 1 - len(lost)  # worker nodes; the head is nodes[0]
        return [self.join_worker(f"healed{len(self.nodes)}", 2 + alive + i, timeout, cwd).name
                for i in range(self.workers - alive)]

    def _api(self, path: str, method: str = "GET") -> Any:
        """The dashboard's answer to PATH (JSON) with this cluster's token; None while it does not answer."""
        req = urllib.request.Request(f"{self.dashboard_url}{path}", method=method, headers={
            "Authorization": f"Bearer {self.token_path.read_text().strip()}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def stop_running_jobs(self, timeout: float = 90) -> list[str]:
        """Stop every job still pending or running (Ray's job REST API) and wait until none is; their
        submission ids. A test that failed with its job still training then leaves the cluster's worker
        nodes to the tests after it, not to that job."""
        def running() -> list[str]:
            found = self._api("/api/jobs/")  # a list of jobs (a dict by job id on some Rays)
            jobs = list(found.values()) if isinstance(found, dict) else found or []
            return [j["submission_id"] for j in jobs if isinstance(j, dict)
                    and j.get("status") in ("PENDING", "RUNNING") and j.get("submission_id")]

        stopped, deadline = running(), time.monotonic() + timeout
        for sid in stopped:
            self._api(f"/api/jobs/{sid}/stop", method="POST")
        while stopped and running() and time.monotonic() < deadline:
            time.sleep(1)
        return stopped

    def state(self, resource: str, **filters: str) -> list[dict] | None:
        """Ray's state API over HTTP (`/api/v0/nodes`, `/api/v0/actors`, ...) with this cluster's
        token; None while the dashboard does not answer."""
        query = "&".join(f"filter_keys={k}&filter_predicates=%3D&filter_values={v}"
                         for k, v in filters.items())
        found = self._api(f"/api/v0/{resource}?limit=10000&detail=true&{query}")
        try:
            return found["data"]["result"]["result"]
        except (TypeError, KeyError):
            return None

    def alive_nodes(self) -> int:
        """Alive nodes (-1 while the dashboard does not answer)."""
        nodes = self.state("nodes", state="ALIVE")
        return -1 if nodes is None else len(nodes)

    def wait_for_nodes(self, count: int, timeout: float, started: Node | None = None) -> None:
        """Until `count` nodes are alive; with `started` (the node just started), fails at once if its
        `ray start` exits first (Ray gives a new raylet a fixed 30 s to register with the GCS)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_nodes() >= count:
                return
            if started is not None and not _session_pids(started.pid):
                raise StartExited(f"node {started.name}: `ray start` exited before the node joined; "
                                      f"logs in {self.dir / 'logs'}\n{self._tails([started])}")
            time.sleep(0.5)
        raise RuntimeError(f"the cluster did not reach {count} alive nodes in {timeout:.0f}s (saw "
                           f"{self.alive_nodes()}); logs in {self.dir / 'logs'}\n{self._tails(self.nodes)}")

    @staticmethod
    def _tails(nodes: list[Node]) -> str:
        return "\n".join(f"--- {n.log}\n"
                         + "".join(Path(n.log).read_text(errors="replace").splitlines(True)[-8:])
                         for n in nodes if Path(n.log).exists())

    def wait_for_jobs(self, timeout: float) -> None:
        """Until a no-op job runs: the head's job agent registers some seconds after the node."""
        deadline = time.monotonic() + timeout
        last: str | list[str] = ""
        while time.monotonic() < deadline:
            r = subprocess.run([RAY, "job", "submit", "--address", self.dashboard_url,
                                "--entrypoint-num-cpus=0", "--", "true"],
                               env=self.env(), capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                return
            last = (r.stderr or r.stdout).strip().splitlines()[-1:]
            time.sleep(2)
        raise RuntimeError(f"the cluster accepts no jobs after {timeout:.0f}s ({last}); "
                           f"logs in {self.dir / 'logs'}")

    def pids(self) -> list[int]:
        """Every process of every node."""
        return _session_pids(*(n.pid for n in self.nodes))

    def node_pids(self, name: str) -> dict[str, int]:
        """{process name: pid} of one node's processes (e.g. 'raylet')."""
        node = next(n for n in self.nodes if n.name == name)
        return {_comm(pid): pid for pid in _session_pids(node.pid)}

    def spare_pids(self) -> dict[int, Path]:
        """This cluster's idle spare worker processes (trainapp/launch/ray/spares.py): {pid: its file}, for
        the files whose process is a child of one of the cluster's Raylets."""
        raylets = {self.node_pids(n.name).get("raylet") for n in self.nodes}
        found = {}
        for path in spares.root().glob("*/*/spare-*"):
            pid = int(path.name.split("-")[1])
            stat = proc_stat(pid)
            if stat is not None and int(stat[1][1]) in raylets:
                found[pid] = path
        return found

    def actor_pids(self, class_name: str) -> list[int]:
        """PIDs of this cluster's live actors of `class_name`, by the process title Ray gives an actor's
        worker (`ray::CLASS` idle, `ray::CLASS.method` busy): read from /proc in milliseconds, where the
        state API goes through the head's dashboard."""
        pids = []
        for pid in _session_pids(*(n.pid for n in self.nodes)):
            with contextlib.suppress(OSError):
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                if title.split(".")[0].split()[0:1] == [f"ray::{class_name}"]:
                    pids.append(pid)
        return pids

    def down(self, grace: float = 15) -> None:
        for node in reversed(self.nodes):  # workers first, the head last
            if not _session_pids(node.pid):
                continue
            try:
                os.killpg(node.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_session_pids(n.pid) for n in self.nodes):
            time.sleep(0.3)
        _kill_sessions(*(n.pid for n in self.nodes))
        self.nodes = []
        (self.dir / STATE).unlink(missing_ok=True)

    # -- state file -----------------------------------------------------------------------------

    def _save(self) -> None:
        data = {**asdict(self), "dir": str(self.dir)}
        (self.dir / STATE).write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, directory: Path) -> "LocalCluster":
        path = directory / STATE
        if not path.exists():
            raise SystemExit(f"local ray cluster: no cluster recorded in {directory}; "
                             "start one with `make ray-up`")
        data = json.loads(path.read_text())
        data["dir"] = Path(data["dir"])
        data["nodes"] = [Node(**n) for n in data["nodes"]]
        return cls(**data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devtools.local_ray",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                   help=f"cluster state, token, logs (default {DEFAULT_DIR})")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a head and N worker nodes on loopback (127.0.0.2, .3, ...)")
    up.add_argument("--workers", type=int, default=2)
    up.add_argument("--cpus", type=float, default=1, help="CPUs each worker node offers")
    up.add_argument("--port", type=int, default=26379, help="GCS port of the head")
    up.add_argument("--dashboard-port", type=int, default=28265)
    up.add_argument("--health-check-period-ms", type=int, default=LocalCluster.health_check_period_ms)
    up.add_argument("--health-check-failure-threshold", type=int,
                    default=LocalCluster.health_check_failure_threshold)
    up.add_argument("--metrics", action="store_true",
                    help="keep Ray's metrics export on (Prometheus/Grafana)")
    up.add_argument("--node-memory", metavar="SIZE", default="",
                    help="give each worker node a /dev/shm of its own of SIZE (e.g. 512m; needs root), as "
                         "separate machines have: the memory tier's copies of a lost node go with it")
    sub.add_parser("down", help="end exactly the processes `up` started")
    sub.add_parser("status", help="alive nodes and how to reach the cluster")
    sb = sub.add_parser("submit", help="ray job submit to this cluster (token passed along)")
    sb.add_argument("--working-dir", metavar="DIR", help="ship DIR with the job (your task's package): "
                                                          "Ray uploads it and every worker imports from it")
    sb.add_argument("entrypoint", nargs=argparse.REMAINDER, help="-- python -m trainapp ray ...")
    args = p.parse_args(argv)

    if args.cmd == "up":
        c = LocalCluster(args.dir, args.workers, args.cpus,
                         gcs_port=args.port, dashboard_port=args.dashboard_port,
                         health_check_period_ms=args.health_check_period_ms,
                         health_check_failure_threshold=args.health_check_failure_threshold,
                         metrics=args.metrics, node_memory=args.node_memory).up()
        print(f"local ray cluster: {1 + c.workers} nodes up (head + {c.workers} x {c.cpus:g} CPU); "
              f"dashboard {c.dashboard_url}")
        print(f"  submit: make ray-submit   (or: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={c.token_path} "
              f"ray job submit --address {c.dashboard_url} -- python -m trainapp ray ...)")
        return 0
    c = LocalCluster.load(args.dir)
    if args.cmd == "down":
        c.down()
        print(f"local ray cluster: stopped {c.dir}")
    elif args.cmd == "status":
        print(f"local ray cluster: {c.alive_nodes()} alive nodes; GCS {c.address}; "
              f"dashboard {c.dashboard_url}; token {c.token_path}")
    elif args.cmd == "submit":
        entry = args.entrypoint[1:] if args.entrypoint[:1] == ["--"] else args.entrypoint
        if not entry:
            raise SystemExit("local ray cluster submit: give the entrypoint after --, "
                             "e.g. -- python -m trainapp ray")
        ship = ["--working-dir", args.working_dir] if args.working_dir else []
        # `ray job stop` waits this long for the stop snapshot before it kills the job
        # (trainapp/launch/ray/stop.py).
        wait = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S)}})
        return subprocess.call([RAY, "job", "submit", "--address", c.dashboard_url, *ship,
                                "--runtime-env-json", wait, "--", *entry], env=c.env())
    return 0


if __name__ == "__main__":
    sys.exit(main())
