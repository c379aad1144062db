"""The run's state: one registry of the parts a snapshot must hold to continue exactly, and the
random generators of every rank, the registry's last part.

`TrainState` maps a name to each stateful part (data progress, model, optimizer, schedule,
GradScaler, EMA, RNG). Its `state_dict()` / `load_state_dict()` walk the registry, so saving and
resuming name the parts in one place, and adding a part (a sampler cursor, a watchdog counter) is one
entry. The names are the keys of a snapshot's `state.pt`.

Parts load in registration order and the RNG comes last: nothing that runs while the others load
may shift the generators the uninterrupted run would have had.

A part marked `sharded` (`ShardedState`: an FSDP run's model and optimizer) is not in `state.pt`: every
rank saves its shard of it beside it (`shards()`, written by trainapp/snapshots/store.py), and
`state.pt` holds the marker SHARDED in its place.
"""

from __future__ import annotations

import hashlib
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from trainapp.errors import ConfigError
from trainapp.snapshots import loadable
from trainapp.snapshots.files import local_bytes
from trainapp.snapshots.store import LOCAL_COPY, SHARDED, SHARDS

if TYPE_CHECKING:
    from trainapp.group import DistContext

class Position(Protocol):
    """Where training is: trainapp/core/data.py's Progress, which `build` registers first (what a
    snapshot's RNG state is saved at)."""

    @property
    def global_step(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def epoch_sample(self) -> int: ...


log = logging.getLogger(__name__)

MEMORY = "__memory__"
"""The key that marks a state as one rank's share (the memory tier's), not rank 0's gathered whole."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class ShardedState:
    """An FSDP run's model and optimizer state (or a module alone: the EMA copy, sharded as the model is):
    every rank's shard, through torch.distributed.checkpoint (DCP) and its state-dict API, which names
    each value by its parameter's fully qualified name and reshards on load when the world size
    changed. Saving and loading are collectives of every rank."""

    sharded = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        # The optimizer's state is made if not yet there.
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optim}

    def own_state_dict(self) -> dict[str, Any]:
        """This rank's shards as plain tensors (the memory tier's copy): each DTensor's local part."""
        return _local(self.state_dict())

    def load_own(self, own: dict[str, Any]) -> None:
        """This rank's shards back from `own_state_dict`, at the world size and sharding they were taken at
        (the memory tier checks the world size): copied into the live state's local parts, then set."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        live = self.state_dict()
        _copy_into(live, own, "")
        if self.optimizer is None:
            set_model_state_dict(self.model, live["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=live["model"],
                           optim_state_dict=live["optimizer"])

    def load_from(self, path: Path, name: str) -> None:
        """Every rank: load this part, saved as `name` among the snapshot's shards at `path`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = {name: self.state_dict()}  # the shapes and shards to load into, keyed as they were saved
        dcp.load(state, checkpoint_id=str(path))
        if self.optimizer is None:
            set_model_state_dict(self.model, state[name]["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optimizer"])


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """An optimizer's state bytes on this rank; twice its parameters' before it has any."""
    if optimizer.state:
        return local_bytes(list(optimizer.state.values()))
    return 2 * local_bytes([p for group in optimizer.param_groups for p in group["params"]])


def _local(obj: Any) -> Any:
    """`obj` with every DTensor replaced by its local part (a plain tensor)."""
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return obj.to_local() if hasattr(obj, "to_local") else obj


def _copy_into(live: Any, own: Any, where: str) -> Any:
    """`own`'s values (`_local`'s) into the live state `live`, in place where it holds tensors."""
    if isinstance(live, dict):
        if set(live) != set(own):
            raise ValueError(f"the memory copy's {where or 'state'} has other entries than this run's")
        for k in live:
            live[k] = _copy_into(live[k], own[k], f"{where}.{k}" if where else str(k))
        return live
    if isinstance(live, (list, tuple)):
        return type(live)(_copy_into(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(live, own)))
    if isinstance(live, torch.Tensor):
        local = live.to_local() if hasattr(live, "to_local") else live
        if local.shape != own.shape:
            raise ValueError(f"the memory copy's {where} has shape {tuple(own.shape)}, this rank's shard "
                             f"{tuple(local.shape)}")
        local.copy_(own)
        return live
    return own


class TrainState:
    """`parts`: name -> stateful part, or None for a part this run does not have (no EMA): it saves as
    None, and a snapshot that holds one is read without it. `records`: saved for the reader, never
    loaded back (the resolved config)."""

    def __init__(self, parts: dict[str, Stateful | ShardedState | None],
                 records: dict[str, Any] | None = None, task_name: str = ""):
        self.parts, self.records = parts, records or {}
        self.task_name = task_name
        """The task whose state this is (`task.name`), named by `check_loadable`'s error."""

    def state_dict(self, is_main: bool) -> dict[str, Any] | None:
        """Every rank calls this, because a part may gather across ranks (one marked `collective`, as
        the RNG is); the others are read on rank 0 only, the one that writes. None on other ranks.
        ConfigError on rank 0 when the state would not load back (`check_loadable`)."""
        out: dict[str, Any] = {}
        for name, part in self.parts.items():
            if part is None:
                out[name] = None
            elif getattr(part, "sharded", False):
                out[name] = SHARDED
            elif is_main or getattr(part, "collective", False):
                out[name] = part.state_dict()
        if not is_main:
            return None
        state = {**out, **self.records}
        self._refuse(loadable.refusal(state))  # a value that came after the first step's check
        return state

    def own_state_dict(self) -> dict[str, Any]:
        """Every rank, without a collective: its share of the state (a part that gathers across ranks gives
        its own share, `own_state_dict`), marked MEMORY, for the memory tier (trainapp/snapshots/memory.py).
        Loaded by `load_state_dict` on every rank at once (each its own share)."""
        out: dict[str, Any] = {MEMORY: True}
        for name, part in self.parts.items():
            if part is None:
                out[name] = None
            elif getattr(part, "collective", False) or getattr(part, "sharded", False):
                out[name] = cast(Any, part).own_state_dict()
            else:
                out[name] = part.state_dict()
        return {**out, **self.records}

    def own_bytes(self) -> int:
        """About the bytes of `own_state_dict`'s tensors, made without touching the state (before the first
        step an optimizer has no state, and asking DCP for an FSDP optimizer's would make it by an optimizer
        step, with lr 0 but weight decay in SGD's momentum): what exists, and twice the parameters for an
        optimizer without state yet (Adam's two moments; SGD's momentum is one). The parts that gather
        across ranks (generators, a stream's position) hold no tensors to speak of: not counted."""
        total = 0
        for part in self.parts.values():
            if isinstance(part, torch.optim.Optimizer):
                total += _optimizer_bytes(part)
            elif isinstance(part, ShardedState):
                total += local_bytes(part.model.state_dict())  # a DTensor counts its local part
                total += _optimizer_bytes(part.optimizer) if part.optimizer is not None else 0
            elif part is not None and not getattr(part, "collective", False):  # those hold a few numbers
                total += local_bytes(part.state_dict())
        return total

    def check_loadable(self) -> None:
        """ConfigError naming the first value a storage snapshot of this state would not load back
        (`loadable.refusal`): a task's numpy array, a model's extra state of its own class. Every rank, no
        collective, before the first step: the parts that gather across ranks (trainapp's own numbers)
        and the sharded ones (DCP's format) are left out."""
        own = {name: part.state_dict() for name, part in self.parts.items()
               if part is not None and not getattr(part, "collective", False)
               and not getattr(part, "sharded", False)}
        self._refuse(loadable.refusal({**own, **self.records}))

    def _refuse(self, refused: str | None) -> None:
        if refused is not None:
            raise ConfigError(f"task.name={self.task_name!r}: no snapshot of this run could be resumed: its "
                              f"{refused}; keep tensors, numbers, strings, lists and dicts in the state (a "
                              "numpy array: torch.from_numpy; docs/your-own-model.md)")

    def shards(self) -> dict[str, Any] | None:
        """Every rank: this rank's shard of every sharded part (DCP's state dict), None without one."""
        out = {name: part.state_dict() for name, part in self.parts.items()
               if part is not None and getattr(part, "sharded", False)}
        return out or None

    def resume(self, found: tuple[str, dict[str, Any]], run_dir: str) -> None:
        """Load the snapshot `found` ((where, state)) into every part; ConfigError naming `run_dir` when
        it does not fit this run's parts (another model, another config)."""
        where, snap = found
        try:
            self.load_state_dict(snap, Path(snap.get(LOCAL_COPY, where)))  # a URI's: downloaded
        except (RuntimeError, ValueError, KeyError) as e:
            first = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
            raise ConfigError(f"run.dir={run_dir}: snapshot {where} does not fit this config ({first}); "
                              "use a new run.dir or the config it was written with") from None
        p = cast(Position, self.parts["progress"])  # data.Progress, the first part `build` registers
        log.info("resumed from %s: step=%d epoch=%d epoch_sample=%d", where, p.global_step, p.epoch,
                 p.epoch_sample)

    def load_state_dict(self, state: dict[str, Any], where: Path | None = None) -> None:
        """`where`: the snapshot's directory, whose shards a sharded part loads."""
        for name, part in self.parts.items():
            if part is None:
                continue
            if state.get(name) is None:
                raise ValueError(f"the snapshot has no {name} state")
            if state.get(MEMORY) and getattr(part, "sharded", False):
                cast(ShardedState, part).load_own(state[name])  # this rank's shards, as they were
                continue
            sharded = isinstance(state[name], str) and state[name] == SHARDED
            if getattr(part, "sharded", False) != sharded:
                raise ValueError(f"its {name} state is {'sharded' if sharded else 'whole'}, this run's is "
                                 "not (parallel.strategy changed)")
            # Only ShardedState is `sharded` (checked just above), and a sharded snapshot is resumed from
            # its directory.
            if sharded:
                assert isinstance(part, ShardedState) and where is not None
                part.load_from(where / SHARDS, name)
            elif state.get(MEMORY) and getattr(part, "collective", False):
                cast(Any, part).load_own(state[name])  # every rank's share merged (a collective)
            else:
                assert not isinstance(part, ShardedState)
                part.load_state_dict(state[name])


def derived_seed(*keys: object) -> int:
    """A 63-bit seed made from `keys` (the run's seed, then what the draws belong to): the same keys give
    the same seed in every process, whatever ran before."""
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device, cuda: Any = torch.cuda) -> dict[str, Any]:
    """This process's generators as plain Python values (bytes, ints): they travel through
    gather_object and load with torch.load(weights_only=True). Of CUDA's, only the generator of this
    rank's own `device`: a rank on an 8-GPU node sees 8, and the node a run resumes on may show fewer.
    `cuda`: torch.cuda, or a stand-in with its `get_rng_state(device)`."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy's stub types get_state() as a dict or the tuple: legacy=True (the default) gives the tuple.
        "numpy": (kind, keys.tobytes(), pos, has_gauss, cached),  # type: ignore[attr-defined]
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": cuda.get_rng_state(device).numpy().tobytes() if device.type == "cuda" else None,
    }


def _byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def own_cuda_state(saved: Any, device: torch.device) -> bytes | None:
    """This rank's CUDA generator state in a snapshot's entry for the rank: bytes (this rank's device's),
    or, from snapshots written before, a list of every visible GPU's, of which the rank's own device's
    is taken (none when the device's index is past the list: the run then goes on from the seed)."""
    if isinstance(saved, (bytes, bytearray)):
        return bytes(saved)
    if isinstance(saved, (list, tuple)) and device.type == "cuda" and (device.index or 0) < len(saved):
        return saved[device.index or 0]
    return None


def set_rng_state(state: dict[str, Any], device: torch.device, cuda: Any = torch.cuda) -> None:
    """`cuda`: torch.cuda, or a stand-in with its `set_rng_state(state, device)`."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    own = own_cuda_state(state.get("cuda"), device)
    if device.type == "cuda" and own is not None:
        cuda.set_rng_state(_byte_tensor(own), device)


class RngState:
    """Every rank's generators, not just rank 0's: saving gathers them to rank 0 (a collective), and
    loading gives each rank its own. A rank the snapshot did not have (resumed at a larger world
    size) gets a seed made from its rank and the step instead."""

    collective = True

    def __init__(self, ctx: DistContext, seed: int, progress: Position, cuda: Any = torch.cuda):
        """Seeds this rank's generators apart from the others' (dropout, augmentation) until a snapshot's
        are loaded. `cuda`: torch.cuda, or a stand-in for its generator (tests on machines without one)."""
        self.ctx, self.seed, self.progress, self.cuda = ctx, seed, progress, cuda
        seed_all(seed + 1000 * ctx.rank)

    def state_dict(self) -> list[dict[str, Any]] | None:
        return self.ctx.gather_objects(rng_state(self.ctx.device, self.cuda))

    def own_state_dict(self) -> dict[str, Any]:
        """This rank's generators alone (the memory tier's copy: no collective)."""
        return rng_state(self.ctx.device, self.cuda)

    def load_own(self, own: dict[str, Any]) -> None:
        """Every rank, from its own generators' state: as `load_state_dict` of every rank's."""
        self.load_state_dict(self.ctx.all_gather_objects(own))

    def load_state_dict(self, rngs: list[dict[str, Any]]) -> None:
        if self.ctx.rank < len(rngs):
            set_rng_state(rngs[self.ctx.rank], self.ctx.device, self.cuda)
        else:
            seed_all(self.seed + 1000 * self.ctx.rank + self.progress.global_step)
