"""Config sections of the launchers: the process group, the network interface, Ray Train."""

from __future__ import annotations

import re
from typing import Literal, Optional, Union

from pydantic import Field
from pydantic.dataclasses import dataclass

from trainapp.config.base import STRICT
from trainapp.errors import ConfigError


@dataclass(config=STRICT)
class DistSection:
    timeout_s: float = Field(default=300.0, gt=0)
    """Timeout of process-group creation and of every collective, in seconds (the Gloo side groups'
    too: the stop vote, the snapshot agreement and every wait on rank 0's file work)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where each rank trains. `cuda`: its GPU (NCCL between ranks); where CUDA is unusable (no driver,
    a driver too old for this torch, a CPU-only torch) the run stops before any process group with one
    line saying why. `auto`: `cuda` when the launcher gave the process GPUs (`CUDA_VISIBLE_DEVICES`
    naming devices, Slurm's `SLURM_GPUS_ON_NODE`, Ray's `ray.use_gpu`) or CUDA is usable, else `cpu`
    (Gloo); GPUs allotted but unusable stop the run the same way instead of training on the CPU.
    `cpu`: the CPU even where GPUs are (Gloo). More ranks on a node than GPUs it shows them: refused."""

@dataclass(config=STRICT)
class ParallelSection:
    """How the model is spread over the ranks (trainapp/core/parallel/)."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """`ddp`: every rank holds the whole model, gradients all-reduced (DistributedDataParallel). `fsdp`:
    parameters, gradients and optimizer state sharded over the ranks (FSDP2, `fully_shard`), for a model
    whose training state does not fit one device; snapshots are then sharded too (every rank writes its
    shard, torch.distributed.checkpoint), and a run resumes at another world size by resharding."""
    fsdp_units: list[str] = Field(default_factory=list)
    """fsdp: class names of the modules sharded as units (each gathers its parameters for its own forward
    and backward only), e.g. `[TransformerBlock]`. Empty: the task's `shard_units(model)` if it has one,
    else every child of the model that holds parameters, each item of a Sequential or ModuleList child
    a unit of its own (the built-in char_lm's transformer blocks, the image CNNs' stages)."""
    reshard_after_forward: bool = True
    """fsdp: free a unit's gathered parameters after its forward (gathered again for the backward): less
    memory, one more all-gather per unit and step."""
    fsdp_param_dtype: Literal["fp32", "amp"] = "fp32"
    """fsdp: the dtype a unit gathers its parameters in. `fp32`: as they are stored, the forward under
    autocast (`amp.dtype`), as under DDP. `amp`: in `amp.dtype` (FSDP2's MixedPrecisionPolicy): half the
    bytes of every all-gather and of the gathered parameters, the gradients reduce-scattered and
    accumulated in fp32 into the fp32 shards the optimizer steps; BatchNorm layers stay fp32 (units of
    their own: their running statistics are fp32). No difference with `amp.dtype=off`."""
    compile: bool = False
    """torch.compile each unit's forward (the units: `fsdp_units` as under FSDP, whatever the strategy;
    a model without units as a whole), before it is sharded or wrapped in DDP: each unit's forward and
    backward become graphs of their own, so DDP's buckets and FSDP's reduce-scatters still start as each
    unit's backward ends. Graph breaks are allowed (the first is named in one warning). The compiled code
    is carried with the run (`run.dir/compile/`), so a restart on a node with an empty local cache loads it
    instead of compiling again (docs/compile.md)."""
    activation_checkpoint: Literal["none", "full"] = "none"
    """`full`: each unit keeps only its inputs for the backward, which runs its forward again
    (torch.utils.checkpoint, non-reentrant, the RNG state restored): the activation memory of one unit
    instead of all of them, for about one more forward per step. The same math: bitwise the same run."""


_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


@dataclass(config=STRICT)
class NetworkSection:
    """Which network interface NCCL and Gloo use: resolved on every node before the process group."""

    interface: str = "auto"
    """`auto`: on each node, the interface whose address routes to the rendezvous address (MASTER_ADDR
    under torchrun, the Ray head under Ray). A name or comma list (`eth0`, `ens5,ens6`): exactly those,
    checked to exist with an IPv4 address on every node. `^lo,docker0`: any interface but those.
    Exported as NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (Gloo gets one name); a variable already set
    in the environment wins."""
    nccl: dict[str, str] = Field(default_factory=dict)
    """Other NCCL variables to export on every node, e.g. `{NCCL_IB_DISABLE: 1, NCCL_DEBUG: INFO}`
    (an environment variable of the same name wins)."""
    check_timeout_s: float = Field(default=60.0, gt=0)
    """How long each rank waits for every rank's interface check before the process group is created;
    a rank whose check failed stops all of them at once."""

    def __post_init__(self) -> None:
        spec = self.interface.strip()
        names = [n.strip() for n in spec.removeprefix("^").split(",")]
        if spec != "auto" and (not spec or not all(_IFNAME.match(n) for n in names)):
            raise ConfigError(f"network.interface={self.interface!r}: expected auto, an interface name or "
                              "comma list (eth0, ens5,ens6) or an exclusion (^lo,docker0)")
        self.interface = spec
        bad = [k for k in self.nccl if not re.fullmatch(r"NCCL_[A-Z0-9_]+", k)]
        if bad:
            raise ConfigError(f"network.nccl.{bad[0]}: only NCCL_* variables go here; put other variables in "
                              "ray.env or the environment")
        if "NCCL_SOCKET_IFNAME" in self.nccl:
            raise ConfigError("network.nccl.NCCL_SOCKET_IFNAME: set network.interface instead "
                              "(it also sets Gloo's)")


@dataclass(config=STRICT)
class RaySection:
    """`python -m trainapp ray`: Ray Train's TorchTrainer runs the same loop on a Ray cluster."""

    address: str = ""
    """Cluster to join: empty means the one this job runs in (`ray job submit` sets RAY_ADDRESS) or,
    with none, an embedded local Ray instance; else `host:port` of the head's GCS, or `auto`."""
    num_workers: Union[int, tuple[int, int]] = 2
    """Training workers (one process each, one GPU each with `ray.use_gpu`): an int, or `[min, max]`
    for elastic training that continues on fewer workers when nodes are lost."""
    use_gpu: Optional[bool] = None
    """One GPU per worker and NCCL. Empty: true when the cluster has GPUs."""
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    """Ray resources each worker reserves, e.g. `{CPU: 4, GPU: 1}`. Empty: 1 CPU (and 1 GPU with use_gpu)."""
    storage_path: str = "runs/ray"
    """Where snapshots (Ray checkpoints) and metrics.jsonl go: a path every node sees (NFS, a
    ReadWriteMany volume) or a URI such as `s3://bucket/runs`. A relative path is taken from the
    driver's working directory."""
    name: str = "trainapp"
    """Run name under `ray.storage_path`. Resubmitting with the same name resumes that run."""
    max_failures: int = Field(default=3, ge=-1)
    """Worker-group restarts after failures (each resumes from the newest snapshot); -1: unlimited."""
    threads_per_worker: Optional[int] = Field(default=None, ge=1)
    """Intra-op threads of each worker (torch.set_num_threads, OMP_NUM_THREADS). Empty: the CPUs the
    worker reserves."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables set in every worker before the process group is created."""
    checks_timeout_s: float = Field(default=180.0, gt=0)
    """How long the driver waits for the checks on every node (`ray.storage_path` writable,
    `network.interface` resolved) before it stops with one line. Each check is a task in the job's
    runtime env: a node's first one waits for a worker process and that env (a `--working-dir`
    download, a pip install), which on a busy node takes more than a minute."""
    worker_group_start_timeout_s: float = Field(default=60.0, gt=0)
    """Ray Train gives up starting a worker group after this long and retries (possibly with fewer
    workers when elastic). Ray's default is 60 s. With `ray.node_loss_wait_s` the restart after a
    lost node is sized for the nodes that are left, so it does not wait this out."""
    health_check_interval_s: float = Field(default=0.25, gt=0)
    """How often Ray Train's controller polls the workers (Ray's default: 2 s). It bounds how fast a dead
    worker is noticed, and each poll costs every worker a little CPU (docs/benchmarks.md). A report
    waits for the next poll: reports more often than this (`ray.report_interval_s`) stall training."""
    node_loss_wait_s: float = Field(default=30.0, ge=0)
    """Elastic runs: when a node that hosted workers stops answering, the restart waits up to this long
    for Ray to declare it dead (its GCS health checks; about 15 s by Ray's defaults), so the new group
    fits the nodes left instead of waiting out `worker_group_start_timeout_s`. 0: do not wait."""
    resize_check_s: float = Field(default=10.0, gt=0)
    """Elastic runs: how often Ray Train checks whether the group can grow (a lost node back, room
    freed). A resize snapshots the step reached and the new group resumes from it, with the same global
    batch (`train.on_resize`). Ray's default: 60 s."""
    report_interval_s: float = Field(default=5.0, ge=0)
    """Seconds between registering snapshots with Ray (`ray.train.report`, a barrier); a restart resumes
    from the newest snapshot on storage, registered or not. 0: every snapshot (docs/ray.md)."""
    check_resources: bool = True
    """Refuse to start when the cluster can never hold `ray.num_workers` (min) workers. Turn off on
    autoscaling clusters that grow on demand."""
    spare_workers: bool = True
    """Keep, on each node, one idle worker process per training worker there with the training worker's
    imports done (Ray Train, torch, trainapp), so that the group Ray Train starts after a failure begins
    in those processes instead of fresh ones, seconds sooner (docs/ray.md, "Spare workers"). A spare
    holds a process's host memory (with torch imported) while the job lasts, and no GPU memory: a node
    gets only the spares its memory has room for below Ray's memory monitor's threshold (one line says
    so when that is fewer)."""
    spare_after_s: float = Field(default=30.0, ge=0)
    """Seconds after a worker starts before its node's spares start: each spare's imports take seconds of a
    CPU core beside the steps, which a run that ends sooner need not pay."""

    def __post_init__(self) -> None:
        n = self.num_workers
        lo, hi = (n, n) if isinstance(n, int) else n
        if lo < 1 or lo > hi:
            raise ConfigError(f"ray.num_workers={list(n) if isinstance(n, tuple) else n}: "
                              "need an int >= 1 or [min, max] with 1 <= min <= max")
        if not self.name or "/" in self.name:
            raise ConfigError(f"ray.name={self.name!r}: must be a non-empty name without '/'")

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    @property
    def elastic(self) -> bool:
        """A range of workers: Ray Train may resize the group while it trains."""
        return self.min_workers != self.max_workers


