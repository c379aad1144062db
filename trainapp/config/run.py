"""Config sections of the run itself: where it lives, its task, the image task's data and model,
training, optimizer, schedule, mixed precision, snapshots and per-rank timings."""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import Any, Literal, Optional

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from trainapp.config.base import STRICT


@dataclass(config=STRICT)
class RunSection:
    dir: str = "runs/default"
    """Run directory: snapshots go to `DIR/snapshots/`, metrics to `DIR/metrics.jsonl`. Re-running with
    the same dir resumes from its newest valid snapshot; under multi-node torchrun it must be storage
    every node sees."""
    lease_s: float = Field(default=30.0, ge=0)
    """Term of the run's lease on its directory (docs/run-directory.md): while a run renews it (every
    term/6, at most every 2 s), another run on the same directory stops in seconds; once the renewals
    have stopped this long (a holder killed or frozen on another host) a new run takes it over. 0: no
    lease (two runs on one directory then mix their snapshots)."""
    take_over: bool = False
    """Take the lease now from a holder that still looks alive (you know it is dead: its node is gone).
    If it is alive after all, it stops at its next write and publishes nothing more."""
    allow_changes: list[str] = Field(default_factory=list)
    """Keys (or whole sections: `data`) a resume may change although they make the snapshot's state
    meaningless (`seed`, `task.*`, the image task's model and dataset; trainapp/config/changes.py). Other
    changes are listed in one line and the run goes on."""

    export: bool = True
    """At the end of the run, export the final model (its EMA copy when `train.ema_decay` > 0) to
    `run.dir/model/` (under Ray beside the snapshots on `ray.storage_path`): `model.safetensors` under the
    model's own names and `trainapp.json`, the same artifact `trainapp export` writes (docs/export.md)."""

    @field_validator("allow_changes", mode="before")
    @classmethod
    def _one_key(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


@dataclass(config=STRICT)
class InitSection:
    from_: str = Field(default="", alias="from")
    """`init.from`: start a new run's model from these weights: an export directory, a `.safetensors` file, a
    run directory (its newest valid snapshot) or a snapshot directory. Only the weights: the optimizer,
    schedule, data position and random generators start fresh. A run with snapshots of its own resumes
    from them and ignores it. Empty: the task's own initialisation."""
    exclude: list[str] = Field(default_factory=list)
    """Parameter names (or prefixes: `head`) of the model left as the task made them, e.g. a new
    classification head of another size; the source's tensors under them are not read."""
    strict: bool = True
    """Every other tensor of the model must come from `init.from` with the same name and shape, and the
    source may hold nothing else; `false` loads what fits and says how much kept the task's values."""

    @field_validator("exclude", mode="before")
    @classmethod
    def _one_prefix(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


BUILTIN_TASKS = ("image_classification", "char_lm")
"""The tasks trainapp ships (trainapp/tasks/); any other `task.name` is an import path."""
TASK_DEFAULTS = MappingProxyType({
    # A transformer wants AdamW and a warmup where the CNN is fine with SGD; two epochs are about a minute
    # on two CPU cores.
    "char_lm": MappingProxyType({"optim.name": "adamw", "optim.weight_decay": 0.01,
                                 "optim.lr": 0.005, "sched.warmup_steps": 30, "train.epochs": 2}),
})
"""A built-in task's defaults for other keys: under the YAML file and the command line, over trainapp's."""
IMPORT_PATH = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


@dataclass(config=STRICT)
class TaskSection:
    name: str = "image_classification"
    """The task: the user's part of a run (datasets, model, loss, evaluation; docs/your-own-model.md).
    `image_classification` (the `data.*` and `model.*` keys configure it), `char_lm` (a character-level
    transformer on a shipped text), or `package.module:attr`, a callable that returns the task."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's factory, e.g. `task.args.hidden=64`, or a mapping in the YAML."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v not in BUILTIN_TASKS and not IMPORT_PATH.fullmatch(v):
            raise ValueError(f"task.name={v!r}: use {' or '.join(BUILTIN_TASKS)}, or an import path "
                             "package.module:attr whose attr returns the task")
        return v


@dataclass(config=STRICT)
class DataSection:
    name: Literal["synthetic", "cifar10", "imagefolder"] = "synthetic"
    """The image task's data (`task.name=image_classification`): `synthetic` (built in, made from
    `seed`, no files), `cifar10` (torchvision's files under `data.root`) or `imagefolder`
    (`data.root/train/<class>/*`, `data.root/val/<class>/*`)."""
    root: str = "data"
    """Dataset directory for `cifar10` and `imagefolder`."""
    image_size: int = Field(default=32, ge=8, le=1024)
    """Side of the square images fed to the model, in pixels."""
    num_workers: int = Field(default=0, ge=0, le=64)
    """DataLoader worker processes per training process (0 loads in the training process), for every task."""
    worker_start_s: float = Field(default=10.0, gt=0, le=600)
    """Seconds a DataLoader worker has to start (to reach its `worker_init_fn`) after it is forked; one
    that has not is killed and the loader's workers started again, up to 3 times
    (trainapp/core/loader_start.py: a fork deadlock of Python 3.11 and older)."""
    shard_retries: int = Field(default=2, ge=0, le=100)
    """A stream's shard that fails to open or read is reopened at the item it had reached this many times
    (0.5 s, 1 s, 2 s ... apart) before it counts as bad (trainapp/core/lane_reader.py)."""
    skip_bad_shards: bool = False
    """Go on without the rest of a stream's shard that stays bad after `data.shard_retries` (each one a
    warning, counted in the end record's `data.skipped_shards`); off: such a shard ends the run with a
    failure record naming it."""
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


@dataclass(config=STRICT)
class ModelSection:
    name: str = "smallcnn"
    """The image task's model: `smallcnn` (built in, trains in seconds on CPU) or a torchvision
    classification model by name
    (`resnet18`, `resnet50`, ...), always built from random weights."""
    num_classes: Optional[int] = Field(default=None, ge=2)
    """Output classes; empty means: take it from the dataset. If set, it must match the dataset."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm when world size > 1 (CUDA only; ignored with a warning on CPU).
    It needs every rank to run the same number of micro-batches per step (a collective in every forward
    and backward): a global batch that does not split evenly over the ranks is refused, on CPU too."""
    channels_last: bool = True
    """Use the channels_last memory format for the model and its inputs: faster convolutions with CUDA
    tensor cores, and faster pooling on CPU (oneDNN)."""


@dataclass(config=STRICT)
class TrainSection:
    epochs: int = Field(default=3, ge=1)
    """Passes over the training set."""
    max_steps: Optional[int] = Field(default=None, ge=1)
    """Optional cap on optimizer steps (stops earlier than `train.epochs` would)."""
    batch_size: int = Field(default=64, ge=1)
    """Micro-batch size per worker process. Global batch = batch_size * grad_accum * world size, unless
    `train.global_batch` is set."""
    grad_accum: int = Field(default=1, ge=1)
    """Micro-batches per optimizer step; the gradient all-reduce runs on the last one only."""
    global_batch: Optional[int] = Field(default=None, ge=1)
    """Samples per optimizer step at every world size (a multiple of `train.batch_size`): each rank runs
    global_batch / (batch_size * world size) micro-batches. Empty: batch_size * grad_accum * the world
    size of the run's first start. Set it for elastic runs that may start small (Ray's elastic runs
    set it from the largest `ray.num_workers` when empty)."""
    on_resize: Literal["keep", "rescale"] = "keep"
    """When a run resumes at another world size: `keep` its global batch (gradient accumulation takes
    up the difference, micro-batches and their randomness are the same at every world size: the same
    run, slower per step on fewer workers), or `rescale` (the global batch follows the world size and
    the peak LR is rescaled by `optim.lr_scaling`)."""
    eval_every: int = Field(default=0, ge=0)
    """Evaluate every N optimizer steps (0: only at the end)."""
    log_every: int = Field(default=10, ge=1)
    """Write a metrics record and a log line every N optimizer steps. Each interval costs one host sync
    and one small all-gather (the loss and every rank's timings) and a file write: at 1, a small model's
    step pays for them every time (docs/benchmarks.md, trainapp against Lightning)."""
    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value after unscaling (0 disables clipping)."""
    ema_decay: float = Field(default=0.0, ge=0, lt=1)
    """Keep an exponential moving average of the weights with this decay and evaluate with it
    (0 disables; 0.999 is typical for long runs)."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    deterministic: bool = False
    """Deterministic GPU kernels, so that a resumed GPU run can match its uninterrupted twin bitwise (on
    CPU it already does): cuDNN's autotuner off and its deterministic algorithms on,
    `torch.use_deterministic_algorithms(True)` (an op without a deterministic kernel raises, naming the
    op), `CUBLAS_WORKSPACE_CONFIG=:4096:8`, TF32 off. Costs speed: convolutions lose the autotuned
    kernels and matmuls the TF32 tensor cores (docs/elastic.md measures it)."""


@dataclass(config=STRICT)
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


@dataclass(config=STRICT)
class SchedSection:
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup from 0 over this many optimizer steps, then cosine decay to the end of training."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the cosine decay as a fraction of the peak learning rate."""


@dataclass(config=STRICT)
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
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false.
        return "off" if v is False else v


@dataclass(config=STRICT)
class SnapshotSection:
    every_steps: int = Field(default=50, ge=0)
    """A snapshot every N optimizer steps and at the end (0: only at the end): written by rank 0 under DDP, by
    every rank (its shard) under FSDP."""
    keep: int = Field(default=3, ge=1)
    """Complete snapshots to keep; older ones are deleted. Keep at least 2 if you want a fallback when
    the newest is found corrupt."""
    async_: bool = Field(default=False, alias="async")
    """`snapshot.async`: rank 0 copies the state to CPU memory and writes it in a background thread,
    so training blocks only for the copy; the next snapshot waits for the previous write. Same atomic,
    checksummed files. Under Ray the write (and the upload to a URI) runs in the background too, and Ray
    registers the snapshot at the next report. With `parallel.strategy=fsdp` every rank writes its shards
    in the background, and the snapshot is published once every rank's are written."""
    max_failures: int = Field(default=3, ge=1)
    """Snapshots that may fail in a row (a full disk, a read-only or unwritable directory, I/O errors)
    before the run stops with exit code 3. A failed snapshot leaves nothing half-written and training
    goes on; on a full disk older snapshots (never the newest valid one) are deleted and the write is
    tried once more. The final snapshot may not fail: a run never reports success without it."""
    memory_every_steps: int | Literal["auto"] = "auto"
    """The memory tier: every N optimizer steps each rank copies its share of the state (what a snapshot
    holds) into `snapshot.memory_dir`, host memory that outlives the training process, and a restart
    resumes from the newest step every rank has there (or on a buddy node), redoing no step since and
    reading nothing from storage; storage snapshots stay the durable tier (docs/preemption.md). 0: off.
    `auto`: the fewest steps between copies that keep a copy's cost at 2% of the steps' time, off when
    the memory directory cannot hold the copies (one warning line)."""
    memory_dir: str = ""
    """Where the memory tier's copies live: a memory filesystem (tmpfs) every process of the node sees;
    empty: `/dev/shm/trainapp-UID`. Each rank keeps two copies of its share (the newest whole while the
    next is written), and one more pair of a buddy's with `snapshot.memory_peer`. The run's copies are
    deleted when it finishes."""
    memory_peer: bool = True
    """Send each memory copy to a buddy rank on another node (the rank one node's worth of ranks on),
    which keeps it in its node's memory: a lost node's state is still in memory elsewhere. A background
    thread sends it; the step never waits on the network. Off on one node."""

    def __post_init__(self) -> None:
        if isinstance(self.memory_every_steps, int) and self.memory_every_steps < 0:
            raise ValueError(f"snapshot.memory_every_steps={self.memory_every_steps}: must be >= 0 (0: off) "
                             "or auto")


@dataclass(config=STRICT)
class ObserveSection:
    ranks: bool = True
    """Time each rank's steps by phase (data, compute, gradient communication wait, optimizer,
    snapshot) and write a `ranks` record at every log interval; rank 0 watches for stragglers. It adds
    no device synchronisation; the timings travel in the log interval's one collective."""
    straggler_ratio: float = Field(default=1.2, gt=1)
    """A rank is a straggler when its step time without communication wait (its own work) is over
    this many times the median of the ranks for `observe.straggler_intervals` log intervals in a row."""
    straggler_intervals: int = Field(default=3, ge=1)
    """Log intervals in a row a rank must be over `observe.straggler_ratio` to be named a straggler:
    one warning line and a `straggler` record naming the rank, host, slow phase and by how much."""
    tensorboard: bool = False
    """Rank 0 also writes loss, lr, samples/s, loss scale, the task's val_* metrics and every rank's step
    time as TensorBoard files under `run.dir/tb`, one timeline across restarts; needs
    `trainapp[tensorboard]`."""
    prometheus_port: int = Field(default=0, ge=0, le=65535)
    """Serve live metrics in Prometheus' format on this port of every node (0: off) under torchrun, Slurm
    or alone: the node's lowest rank serves `http://NODE:PORT/metrics`; rank 0's node adds the run's
    figures (step, loss, samples/s, snapshot, goodput so far, restarts). Under Ray this key is unused:
    `observe.ray_metrics` sends them through Ray's own metrics export (docs/observability.md)."""
    ray_metrics: bool = True
    """Under Ray, each worker records the same figures with `ray.util.metrics`; each node's Ray metrics
    agent serves them (as `ray_trainapp_*`) where Ray's Prometheus scrape already looks."""
    mlflow_uri: str = ""
    """MLflow tracking URI rank 0 logs the run to: a tracking server (`http://mlflow:5000`) or a local
    store (`file:/path/mlruns`, `sqlite:///path/mlflow.db`); empty: off. One MLflow run per run
    directory across every restart, one value per step (docs/observability.md#experiment-tracking);
    needs `trainapp[mlflow]`."""
    mlflow_experiment: str = "trainapp"
    """The MLflow experiment the run goes in (made when missing)."""
    wandb_project: str = ""
    """Weights & Biases project rank 0 logs the run to; empty: off. Entity, mode and key come from W&B's
    own environment variables (`WANDB_ENTITY`, `WANDB_MODE=offline`, `WANDB_API_KEY`); needs
    `trainapp[wandb]`."""
    tracking_wait_s: float = Field(default=30.0, ge=0)
    """At the run's end, how long rank 0 waits for a tracker to take what it has not yet taken (and the
    report and model artifacts); what is still unsent then is named in one warning line and stays in
    metrics.jsonl, and `trainapp track RUN_DIR` sends it later. A stop or failure waits at most 5 s:
    the next attempt sends the rest."""

    def __post_init__(self) -> None:
        scheme = self.mlflow_uri.split(":", 1)[0] if ":" in self.mlflow_uri else ""
        if self.mlflow_uri and scheme not in MLFLOW_SCHEMES:
            raise ValueError(f"observe.mlflow_uri={self.mlflow_uri!r}: unknown scheme {scheme!r}; use "
                             "http(s)://HOST:PORT of a tracking server, file:/PATH or sqlite:///PATH.db "
                             "(or empty: off)")


MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""The tracking URIs MLflow's client takes: a server, or a store it writes itself."""


