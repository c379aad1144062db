"""A private Slurm on one machine: a controller and two compute nodes, each in its own network namespace.

    ctl   (netns) trn0 10.125.0.1   slurmctld
    node1 (netns) trn0 10.125.0.2   slurmd -N node1     \\ one bridge (tests/netns.py's Star),
    node2 (netns) trn0 10.125.0.3   slurmd -N node2     / as nodes on one switch

Each daemon runs with its own host name (UTS namespace) and its own /etc/hosts (a bind mount in a mount
namespace of its own) naming the three hosts, so the node names resolve on every node as on a real
cluster, and nothing of the machine's own /etc/hosts changes. One `munged` with its own key and socket
serves all of them (a socket path is not bound to a network namespace). Config, state, spool and logs
live under one temp dir; ports are Slurm's defaults, inside namespaces nothing else uses.

`run(...)` runs a Slurm command (sbatch, squeue, scontrol, scancel) on the controller's host.
`down()` cancels every job, then ends every process in the namespaces (daemons, slurmstepd and the
job's processes: `ip netns pids`, never by name) and munged by its PID, and deletes the namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import netns

NODES = ("node1", "node2")
CTL = "ctl"

CONF = """\
# A private Slurm for trainapp's tests (tests/slurm_cluster.py). Not for anything else.
ClusterName=trainapp-test
SlurmctldHost={ctl}({ctl_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={dir}/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: the namespaces are the nodes; processes are tracked by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# The nodes are what this file says (one CPU each), not what the machine has.
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=30
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def unavailable() -> str | None:
    """Why a private Slurm cannot run here (None: it can)."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if not shutil.which(b)]
    if missing:
        return (f"{', '.join(missing)} not installed "
                f"(make slurm-smoke installs Debian's slurmctld, slurmd, munge)")
    return netns.unavailable()


class Slurm:
    def __init__(self, root: Path) -> None:
        self.dir = root
        self.net = netns.Star(1 + len(NODES))
        self.ctl, *self.nodes = self.net.hosts
        for host, name in zip(self.net.hosts, (CTL, *NODES)):
            host.hostname = name
        self.conf = root / "slurm.conf"
        self.scratch = root / "scratch"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.env.pop("SLURM_JOB_ID", None)
        self.procs: list[subprocess.Popen] = []
        self.munged_pid: int | None = None

    # --- set-up -------------------------------------------------------------------------------------
    def up(self, timeout: float = 60) -> "Slurm":
        try:
            self.net.up()
            self._files()
            self._munged()
            self._daemon(self.ctl, ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for host in self.nodes:
                self._daemon(host, ["slurmd", "-D", "-N", host.hostname, "-f", str(self.conf)])
            self.wait_idle(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _files(self) -> None:
        for sub in ("state", "log", "scratch", *(f"spool/{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{h.train_ip} {h.hostname}\n" for h in self.net.hosts)
        (self.dir / "hosts").write_text(hosts)
        nodes = "\n".join(f"NodeName={h.hostname} NodeAddr={h.train_ip} CPUs=1 RealMemory=2000 State=UNKNOWN"
                          for h in self.nodes)
        self.conf.write_text(CONF.format(dir=self.dir, ctl=CTL, ctl_ip=self.ctl.train_ip, nodes=nodes))

    def _munged(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run(["munged", f"--socket={self.dir}/munge.sock", f"--key-file={key}",
                        f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                        f"--seed-file={self.dir}/munged.seed", "--force"], check=True, capture_output=True,
                       text=True, timeout=30)
        self.munged_pid = int((self.dir / "munged.pid").read_text())

    def prefix(self, host: netns.Host) -> list[str]:
        """Run on `host`: its network namespace, its host name, its /etc/hosts, and its own empty tmpfs at
        `self.scratch` (node-local scratch, as /scratch or /tmp on real nodes)."""
        script = ('hostname "$0" && mount --bind "$1" /etc/hosts && mount -t tmpfs -o size=16m tmpfs "$2" '
                  '&& shift 2 && exec "$@"')
        # nsenter, not `ip netns exec`: that remounts /sys, which hides the cgroup mounts slurmd checks.
        return ["nsenter", f"--net=/run/netns/{host.ns}", "unshare", "--uts", "--mount", "sh", "-c", script,
                host.hostname, str(self.dir / "hosts"), str(self.scratch)]

    def _daemon(self, host: netns.Host, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{host.hostname}.out", "ab")
        self.procs.append(subprocess.Popen([*self.prefix(host), *cmd], env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            out = r.stdout + r.stderr
            states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            if r.returncode == 0 and all(states.get(n) == "idle" for n in NODES):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args[-5:]}): {self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"Slurm nodes not idle after {timeout} s: {out}\n{self.logs()}")

    # --- use ----------------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 60, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.prefix(self.ctl), *cmd], env={**self.env, **(env or {})},
                           capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit; the job gets this process's environment plus `env` (sbatch's default --export=ALL)."""
        r = self.run("sbatch", "--parsable", *args, env=env, cwd=cwd)
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        r = self.run("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def wait_job(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"), timeout: float = 300
                 ) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        job = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout} s\n{self.logs()}")

    def logs(self, lines: int = 30) -> str:
        out = []
        for f in sorted(self.dir.glob("*.log")) + sorted((self.dir / "log").glob("*.out")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # --- tear-down ----------------------------------------------------------------------------------
    def down(self) -> None:
        if any(p.poll() is None for p in self.procs):
            self.run("scancel", "--full", "--signal=KILL", "--state=RUNNING", check=False, timeout=20)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for host in self.net.hosts:
                pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True).stdout
                for pid in pids.split():
                    try:
                        os.kill(int(pid), sig)
                    except ProcessLookupError:
                        pass
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.munged_pid = None
        self.net.down()
