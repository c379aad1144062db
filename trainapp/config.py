"""Run configuration: dataclass sections, a YAML file, and `section.key=value` overrides.

Precedence: command-line overrides > the `--config` YAML file > the defaults below (with no
`--config`, the built-in run that `make run` uses). Validation is pydantic's (unknown keys, wrong
types, ranges); cross-field checks live in each section's `__post_init__`. Every problem becomes a
`ConfigError` whose message is one line naming the key, the value and what is expected, e.g.
`train.grad_accum=0: must be >= 1`. This module imports neither torch nor ray, so a bad command
line fails in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass

# validate_by_name: a field named after a Python keyword (`async_`) is `snapshot.async` in files and
# on the command line (its alias), and either spelling is accepted back (a dumped config).
_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True,
                     validate_by_name=True, validate_by_alias=True)


def _public(name: str) -> str:
    """The key users write for a field (`async_` -> `async`)."""
    return name[:-1] if name.endswith("_") else name


class ConfigError(ValueError):
    """Bad configuration or bad input: the CLI prints the message as one line and exits 2."""

    failure_cause = ""  # says what is wrong itself: no `failure` record (trainapp/faults/failure.py)


@dataclass(config=_STRICT)
class RunSection:
    dir: str = "runs/default"
    """Run directory: snapshots go to `DIR/snapshots/`, metrics to `DIR/metrics.jsonl`. Re-running with
    the same dir resumes from its newest valid snapshot; under multi-node torchrun it must be storage
    every node sees."""


@dataclass(config=_STRICT)
class DataSection:
    name: Literal["synthetic", "cifar10", "imagefolder"] = "synthetic"
    """`synthetic` (built in, made from `seed`, no files), `cifar10` (torchvision's files under
    `data.root`) or `imagefolder` (`data.root/train/<class>/*`, `data.root/val/<class>/*`)."""
    root: str = "data"
    """Dataset directory for `cifar10` and `imagefolder`."""
    image_size: int = Field(default=32, ge=8, le=1024)
    """Side of the square images fed to the model, in pixels."""
    num_workers: int = Field(default=0, ge=0, le=64)
    """DataLoader worker processes per training process (0 loads in the training process)."""
    download: bool = False
    """Allow `cifar10` to download into `data.root` when it is missing. Off by default: a missing
    dataset is an error, not a surprise 170 MB download on every node."""
    augment: bool = True
    """Random crop and horizontal flip for `cifar10`/`imagefolder` training images (seeded per sample
    and epoch, so a resumed run sees the same augmentations)."""
    train_size: int = Field(default=4096, ge=1)
    """`synthetic` only: number of training images."""
    val_size: int = Field(default=1024, ge=1)
    """`synthetic` only: number of validation images."""
    synthetic_classes: int = Field(default=10, ge=2)
    """`synthetic` only: number of classes."""


@dataclass(config=_STRICT)
class ModelSection:
    name: str = "smallcnn"
    """`smallcnn` (built in, trains in seconds on CPU) or a torchvision classification model by name
    (`resnet18`, `resnet50`, ...), always built from random weights."""
    num_classes: Optional[int] = Field(default=None, ge=2)
    """Output classes; empty means: take it from the dataset. If set, it must match the dataset."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm when world size > 1 (CUDA only; ignored with a warning on CPU)."""
    channels_last: bool = True
    """Use the channels_last memory format for the model and its inputs: faster convolutions with CUDA
    tensor cores, and faster pooling on CPU (oneDNN)."""


@dataclass(config=_STRICT)
class TrainSection:
    epochs: int = Field(default=3, ge=1)
    """Passes over the training set."""
    max_steps: Optional[int] = Field(default=None, ge=1)
    """Optional cap on optimizer steps (stops earlier than `train.epochs` would)."""
    batch_size: int = Field(default=64, ge=1)
    """Micro-batch size per worker process. Global batch = batch_size * grad_accum * world size."""
    grad_accum: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step; the gradient all-reduce runs on the last one only."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate every N optimizer steps (0: only at the end)."""
    log_every: int = Field(default=10, ge=1)
    """Write a metrics record and a log line every N optimizer steps."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value after unscaling (0 disables clipping)."""
    ema_decay: float = Field(default=0.0, ge=0, lt=1)
    """Keep an exponential moving average of the weights with this decay and evaluate with it
    (0 disables; 0.999 is typical for long runs)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""


@dataclass(config=_STRICT)
class OptimSection:
    name: Literal["sgd", "adamw"] = "sgd"
    """Optimizer: `sgd` (with Nesterov momentum) or `adamw`."""
    lr: float = Field(default=0.05, gt=0)
    """Learning rate at the reference global batch `optim.base_batch_size`."""
    momentum: float = Field(default=0.9, ge=0, lt=1)
    """SGD momentum (AdamW uses beta1 = 0.9)."""
    weight_decay: float = Field(default=5e-4, ge=0)
    """Weight decay; never applied to biases and normalization weights."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "linear"
    """Scale `optim.lr` by global batch / base_batch_size (`linear`), its square root (`sqrt`), or not."""
    base_batch_size: int = Field(default=128, ge=1)
    """The global batch size at which `optim.lr` applies unscaled."""
    lr_mult: dict[str, float] = Field(default_factory=dict)
    """Per-module learning-rate multipliers by parameter-name prefix, e.g. `{fc: 10.0}`."""


@dataclass(config=_STRICT)
class SchedSection:
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup from 0 over this many optimizer steps, then cosine decay to the end of training."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the cosine decay as a fraction of the peak learning rate."""


@dataclass(config=_STRICT)
class AmpSection:
    dtype: Literal["auto", "bf16", "fp16", "off"] = "auto"
    """Autocast dtype. `auto`: bf16 where the device supports it, else fp16 with loss scaling (CUDA);
    on CPU bf16 where the CPU has bf16 instructions (AVX512_BF16, AMX, Arm BF16 in /proc/cpuinfo),
    else fp32, because emulated bf16 (oneDNN's path on AVX-512F or AVX2 alone) is slower than fp32.
    `off`: full fp32."""
    init_scale: float = Field(default=2.0**16, gt=0)
    """fp16 only: initial loss scale of the GradScaler."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        # YAML 1.1 reads a bare `off` as false.
        return "off" if v is False else v


@dataclass(config=_STRICT)
class SnapshotSection:
    every_steps: int = Field(default=50, ge=0)
    """Rank 0 writes a snapshot every N optimizer steps and at the end (0: only at the end)."""
    keep: int = Field(default=3, ge=1)
    """Complete snapshots to keep; older ones are deleted. Keep at least 2 if you want a fallback when
    the newest is found corrupt."""
    async_: bool = Field(default=False, alias="async")
    """`snapshot.async`: rank 0 copies the state to CPU memory and writes it in a background thread,
    so training blocks only for the copy; the next snapshot waits for the previous write. Same atomic,
    checksummed files. Under Ray the write (and the upload to a URI) runs in the background too, and Ray
    registers the snapshot at the next report."""
    max_failures: int = Field(default=3, ge=1)
    """Snapshots that may fail in a row (a full disk, a read-only or unwritable directory, I/O errors)
    before the run stops with exit code 3. A failed snapshot leaves nothing half-written and training
    goes on; on a full disk older snapshots (never the newest valid one) are deleted and the write is
    tried once more. The final snapshot may not fail: a run never reports success without it."""


@dataclass(config=_STRICT)
class FaultSection:
    kill_at_step: Optional[int] = Field(default=None, ge=1)
    """Failure drill: rank `fault.rank` kills itself with SIGKILL after optimizer step N, once (a
    marker in `run.dir` stops it from firing again after the restart)."""
    rank: int = Field(default=0, ge=0)
    """The rank the drills (`kill_at_step`, `hang_at_step`, `oom_at_step`) act on."""
    snapshot_write_delay_s: float = Field(default=0.0, ge=0)
    """Failure drill: sleep this long inside every snapshot write, after `state.pt` and before the
    `meta.json` that completes it, so a kill can land mid-write."""
    hang_timeout_s: float = Field(default=60.0, ge=0)
    """Hung-rank watchdog: a rank whose training thread made no progress (no step, data batch, eval
    batch or snapshot chunk) for this long dumps its stacks to `run.dir/hangs/`, says so in one line and
    exits with 124, so the launcher restarts the group from the newest snapshot. A rank blocked in a
    collective by a hung peer counts as hung too. 0: off (the process-group timeout remains)."""
    hang_startup_s: float = Field(default=600.0, gt=0)
    """The watchdog's allowance until the first step is done (imports, data, compilation, the first
    collective): first steps are slow."""
    hang_at_step: Optional[int] = Field(default=None, ge=1)
    """Failure drill: rank `fault.rank` stops making progress after optimizer step N (its training
    thread sleeps, as a stuck data loader would), once (a marker in `run.dir`)."""
    oom_at_step: Optional[int] = Field(default=None, ge=1)
    """Failure drill: rank `fault.rank` raises `torch.OutOfMemoryError` after optimizer step N, once
    (a marker in `run.dir`), as a CUDA allocation beyond the device's memory would: the rank records
    the failure with its memory, its peers follow it out, the launcher restarts the group."""
    slow_rank: Optional[int] = Field(default=None, ge=0)
    """Drill: this rank's every step takes `fault.slow_ms` longer, as on a throttled GPU or a slow disk."""
    slow_ms: float = Field(default=100.0, gt=0)
    """How much longer each step of `fault.slow_rank` takes, in milliseconds."""
    slow_phase: Literal["data", "compute", "optim"] = "compute"
    """Where `fault.slow_rank` loses it: waiting for data, between forward and backward, or the optimizer."""


@dataclass(config=_STRICT)
class ObserveSection:
    ranks: bool = True
    """Time each rank's steps by phase (data, compute, gradient communication wait, optimizer,
    snapshot) and write a `ranks` record at every log interval; rank 0 watches for stragglers. It adds
    no device synchronisation; the timings travel in the log interval's one collective."""
    straggler_ratio: float = Field(default=1.2, gt=1)
    """A rank is a straggler when its step time without communication wait (its own work) is over
    this many times the median of the ranks for `timings.straggler_intervals` log intervals in a row."""
    straggler_intervals: int = Field(default=3, ge=1)
    """Log intervals in a row a rank must be over `timings.straggler_ratio` to be named a straggler:
    one warning line and a `straggler` record naming the rank, host, slow phase and by how much."""
    tensorboard: bool = False
    """Rank 0 also writes loss, lr, samples/s, loss scale, val_acc, val_loss and every rank's step time as
    TensorBoard files under `run.dir/tb`, one timeline across restarts; needs `trainapp[tensorboard]`."""


@dataclass(config=_STRICT)
class DistSection:
    timeout_s: float = Field(default=300.0, gt=0)
    """Timeout of process-group creation and of every collective, in seconds."""


# Signals that cannot be caught (KILL, STOP) or that mean a crash or plumbing: never a preemption notice.
_NOT_NOTICES = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGPIPE"}


@dataclass(config=_STRICT)
class PreemptSection:
    """A preemption notice (SIGTERM from Kubernetes, `docker stop`, a spot reclaim, Slurm's `--signal`;
    a Ray node drain) becomes a snapshot of the step reached, then an exit with 128 + the signal."""

    signals: list[str] = Field(default_factory=list)
    """Signals that also mean "preempted", besides SIGTERM and SIGINT (always handled), e.g.
    `[SIGUSR1]` when a scheduler signals the training processes themselves with it."""
    grace_s: float = Field(default=25.0, gt=0)
    """From the signal to the exit, at most: if the stop cannot be agreed and the snapshot written in
    this time (a peer gone or hung), the process exits anyway and the newest valid snapshot stays what
    it was. Keep it under the platform's grace period (Kubernetes and `docker stop` default to 30 and
    10 s; see k8s/ and docs/preemption.md)."""
    ray_poll_s: float = Field(default=2.0, ge=0)
    """Under Ray Train, while a node of the run is drained (none before): seconds between
    `get_preemption_info()` polls, each with a snapshot; training goes on, and the node's death costs
    at most this long of training plus a vote interval (0.5 s). 0: off (docs/preemption.md)."""

    def __post_init__(self) -> None:
        import signal

        names = []
        for raw in self.signals:
            name = raw.strip().upper()
            name = name if name.startswith("SIG") else "SIG" + name
            if name in _NOT_NOTICES or not isinstance(getattr(signal, name, None), signal.Signals):
                raise ConfigError(f"preempt.signals: {raw!r} is not a signal a notice can use; name one such as "
                                  "SIGUSR1, SIGUSR2 or SIGHUP")
            names.append(name)
        self.signals = names


_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


@dataclass(config=_STRICT)
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
            raise ConfigError(f"network.interface={self.interface!r}: expected auto, an interface name or comma "
                              "list (eth0, ens5,ens6) or an exclusion (^lo,docker0)")
        self.interface = spec
        bad = [k for k in self.nccl if not re.fullmatch(r"NCCL_[A-Z0-9_]+", k)]
        if bad:
            raise ConfigError(f"network.nccl.{bad[0]}: only NCCL_* variables go here; put other variables in "
                              "ray.env or the environment")
        if "NCCL_SOCKET_IFNAME" in self.nccl:
            raise ConfigError("network.nccl.NCCL_SOCKET_IFNAME: set network.interface instead (it also sets Gloo's)")


@dataclass(config=_STRICT)
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
    report_interval_s: float = Field(default=5.0, ge=0)
    """Seconds between registering snapshots with Ray (`ray.train.report`, a barrier); a restart resumes
    from the newest snapshot on storage, registered or not. 0: every snapshot (docs/ray.md)."""
    check_resources: bool = True
    """Refuse to start when the cluster can never hold `ray.num_workers` (min) workers. Turn off on
    autoscaling clusters that grow on demand."""

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


@dataclass(config=_STRICT)
class Config:
    seed: int = 0
    """Seed of the model init, the data order and the synthetic dataset."""
    run: RunSection = dataclasses.field(default_factory=RunSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    sched: SchedSection = dataclasses.field(default_factory=SchedSection)
    amp: AmpSection = dataclasses.field(default_factory=AmpSection)
    snapshot: SnapshotSection = dataclasses.field(default_factory=SnapshotSection)
    fault: FaultSection = dataclasses.field(default_factory=FaultSection)
    observe: ObserveSection = dataclasses.field(default_factory=ObserveSection)
    preempt: PreemptSection = dataclasses.field(default_factory=PreemptSection)
    dist: DistSection = dataclasses.field(default_factory=DistSection)
    network: NetworkSection = dataclasses.field(default_factory=NetworkSection)
    ray: RaySection = dataclasses.field(default_factory=RaySection)

    def __post_init__(self) -> None:
        if self.data.name != "synthetic" and not self.data.root:
            raise ConfigError(f"data.root='': data.name={self.data.name} needs a dataset directory")
        if self.data.name == "synthetic" and self.model.num_classes not in (None, self.data.synthetic_classes):
            raise ConfigError(
                f"model.num_classes={self.model.num_classes}: the synthetic dataset has "
                f"data.synthetic_classes={self.data.synthetic_classes}; set them equal or leave num_classes empty"
            )

    def to_dict(self) -> dict[str, Any]:
        # Field names as users write them; the values of dict fields (ray.env, ...) are left alone.
        return {name: {_public(k): v for k, v in value.items()} if isinstance(value, dict) else value
                for name, value in dataclasses.asdict(self).items()}


_ADAPTER = TypeAdapter(Config)


def _key_of(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _section_of(f: dataclasses.Field):
    """The section class a field holds, or None for a plain value."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def leaves(cls=Config, prefix: str = ""):
    """(dotted key as users write it, the section class, the field) of every leaf key (`train.max_steps`)."""
    for f in dataclasses.fields(cls):
        section = _section_of(f)
        if section:
            yield from leaves(section, f"{prefix}{f.name}.")
        else:
            yield prefix + _public(f.name), cls, f


def _format_error(err: dict) -> str:
    key, kind, value = _key_of(err["loc"]), err["type"], err.get("input")
    known = [k for k, _, _ in leaves()]
    # A union field reports one error per member type (`ray.num_workers.int`): name the field itself.
    while key not in known and "." in key and key.rsplit(".", 1)[0] in known:
        key = key.rsplit(".", 1)[0]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else "; see docs/configuration.md"
        return f"unknown key {key}{hint}"
    msg = err["msg"]
    if kind == "value_error":
        # Our own cross-field checks already name the key and value.
        return msg.removeprefix("Value error, ")
    if kind == "dataclass_type":
        return f"{key}={value!r}: must be a mapping of {key}.* keys"
    return f"{key}={value!r}: {msg[0].lower() + msg[1:]}"


def from_dict(raw: dict[str, Any]) -> Config:
    """Validate a nested mapping into a Config; raise ConfigError naming the first bad key."""
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as e:
        messages: dict[str, str] = {}
        for err in e.errors():
            msg = _format_error(err)
            head, _, tail = msg.partition(": ")
            messages[head] = f"{messages[head]} or {tail}" if head in messages and tail else messages.get(head, msg)
        raise ConfigError("; ".join(messages.values())) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`train.max_steps=50` -> (['train', 'max_steps'], 50). Values are parsed as YAML scalars/flows."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not p.isidentifier() for p in key.split(".")):
        raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted key, e.g. train.max_steps=50")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML: keep the raw string and let the field's type decide
    return key.split("."), value


def _set_dotted(tree: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {p}: no such file; pass an existing YAML file (see configs/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or "malformed YAML"
        raise ConfigError(f"--config {p}: not valid YAML{at} ({problem})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {p}: cannot read it ({e.__class__.__name__}: {e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {p}: top level must be a mapping of sections (run:, train:, ...)")
    return data


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the overrides (CLI > file > defaults)."""
    tree = read_yaml(path) if path else {}
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value, item)
    return from_dict(tree)
