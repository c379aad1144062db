"""Process group set-up that does not care who launched us.

torchrun and Ray Train both export RANK, LOCAL_RANK and WORLD_SIZE; Ray Train also creates the
process group itself. So: ranks come from the environment, a group is created only when none exists,
and only a group we created is destroyed. The result is the rank's `DistContext` (trainapp/group.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import uuid
from typing import Callable

import torch
import torch.distributed as dist

from trainapp.config.launch import DistSection, NetworkSection
from trainapp.errors import ConfigError
from trainapp.group import DistContext
from trainapp.launch import device as device_rule
from trainapp.launch import net

log = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r}: must be an integer "
                          "(set by torchrun or Ray)") from None


def _check_network(network: NetworkSection, store: dist.Store, rank: int, world_size: int) -> net.Resolution:
    """Resolve the interface here, then compare notes with every rank through the store.

    A rank that cannot use the interface says so under its own key and stops; the others read it and
    stop too, with the same line, instead of waiting in the process group for the full timeout.
    """
    try:
        res = net.apply(network, net.rendezvous_from_env())
        store.set(f"net/{rank}", json.dumps({"ok": res.summary(), "host": res.host, "request": res.request,
                                             "address": res.address, "rendezvous": res.rendezvous}))
    except net.NetworkError as e:
        store.set(f"net/{rank}", json.dumps({"error": str(e)}))
        raise
    keys = [f"net/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=network.check_timeout_s))
    except Exception:  # the store raises its own timeout type (DistStoreError or RuntimeError by version)
        missing = [k.split("/")[1] for k in keys if not store.check([k])]
        raise net.NetworkError(f"network.check_timeout_s={network.check_timeout_s:g}: "
                               f"rank(s) {','.join(missing)} never reported their interface check; are all "
                               "nodes started?") from None
    reports = [json.loads(store.get(k)) for k in keys]
    for r, report in enumerate(reports):
        if "error" in report:
            raise net.NetworkError(f"rank {r}: {report['error']}")
        if rank == 0:
            log.info("network rank %d: %s", r, report["ok"])
    net.check_hosts(reports)
    return res


def _elastic_store(timeout: datetime.timedelta) -> tuple[dist.Store | None, str]:
    """Under torchrun: (the agent's store under a prefix that names this attempt of the group, that
    prefix's scope for `side_store`), or (None, "side") when torchrun did not launch us.

    Without the prefix, a group restarted after a peer died mid-all-reduce can read the dead attempt's
    Gloo addresses from the shared store and fail with `connectFullMesh ... Connection refused`.
    """
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") is None:
        return None, "side"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=(not agent_hosts and rank == 0),
                          timeout=timeout, multi_tenant=not agent_hosts)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    name = _agree_on_round(dist.PrefixStore(f"trainapp/{run_id}/rounds", store), rank, world_size, timeout)
    return dist.PrefixStore(f"trainapp/{run_id}/{name}", store), f"{run_id}/{name}/side"


def _agree_on_round(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                    poll_s: float = 0.02) -> str:
    """A fresh name for this attempt of the group, the same on every rank.

    Not TORCHELASTIC_RESTART_COUNT: across nodes it differs after a restart. The agent whose worker
    died counts one; an agent whose workers were healthy restarts them for the new membership without
    counting. And the agent's store outlives attempts, with a dead attempt's keys still in it. So rank
    0 names the attempt (a random id) and hands the name to each rank under a key made of that rank's
    own random nonce, which no dead attempt can have answered; each rank acknowledges under the new
    name. A dead attempt's `hello` is answered too, harmlessly: nobody waits for it."""
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"hello/{rank}", nonce)
        store.wait([f"welcome/{nonce}"], timeout)
        name = store.get(f"welcome/{nonce}").decode()
        store.set(f"ack/{name}/{rank}", "1")
        return name
    name, waiting = f"round-{uuid.uuid4().hex[:12]}", set(range(1, world_size))
    answered: dict[int, str] = {}
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for r in sorted(waiting):
            if store.check([f"ack/{name}/{r}"]):
                waiting.discard(r)
            elif (store.check([f"hello/{r}"])
                    and answered.get(r) != (nonce := store.get(f"hello/{r}").decode())):
                store.set(f"welcome/{nonce}", name)
                answered[r] = nonce
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"dist: rank(s) {sorted(waiting)} did not join this attempt of the group "
                               f"within dist.timeout_s={timeout.total_seconds():.0f}")
        if waiting:
            time.sleep(poll_s)
    return name


def placement(ctx: DistContext) -> dict:
    """Where this rank runs, as its launcher placed it: host, node rank (torchrun's GROUP_RANK, Ray's
    NODE_RANK), local rank, PID."""
    node_rank = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    return {"rank": ctx.rank, "host": os.uname().nodename, "node_rank": int(node_rank) if node_rank else None,
            "local_rank": ctx.local_rank, "pid": os.getpid()}


def side_store(ctx: DistContext, timeout_s: float = 10.0) -> dist.Store | None:
    """A client of the group's store of our own (MASTER_ADDR:MASTER_PORT: torchrun's agent, or rank 0
    under Ray and plain launches), for word between ranks outside the process group, such as a rank's
    failure: a collective cannot carry it, it is what hangs. Keys are scoped to this attempt of the
    group. None alone or when no store address is known."""
    if not ctx.distributed or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"trainapp/{ctx.store_scope}", store)


def setup(cfg: DistSection, network: NetworkSection | None = None,
          ray_device: Callable[[], torch.device] | None = None) -> DistContext:
    """Read ranks from the environment, choose the device (`dist.device`, trainapp/launch/device.py) and
    make sure a process group exists when world size > 1, with a Gloo side group beside it for the
    waits on rank 0's file work.

    `network` (a NetworkSection) is resolved and checked on every rank before a group we create; a
    group someone else created (Ray) was preceded by the same resolution in its backend hook, which
    left its choice in the environment. `ray_device`: under Ray Train, the device Ray gave the worker.
    """
    adopted = dist.is_available() and dist.is_initialized()
    if adopted:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        if not 0 <= rank < world_size:
            raise ConfigError(f"environment RANK={rank}: must be in [0, WORLD_SIZE={world_size})")
    local_rank = _env_int("LOCAL_RANK", 0)
    device, why = device_rule.choose(cfg.device, device_rule.Visible.here(), local_rank,
                                     _env_int("LOCAL_WORLD_SIZE", 1), ray_device)
    if device.type == "cuda":
        # Bound before the group: NCCL creates its communicator on the current device.
        torch.cuda.set_device(device)
    if adopted:
        backend, resolution, scope, owns = dist.get_backend(), net.Resolution.from_environ(), "side", False
    elif world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        resolution, scope = _create_group(cfg, network, backend, rank, world_size)
        owns = True
    else:  # alone: nothing to choose, but a named interface must exist
        backend, scope, owns = None, "side", False
        resolution = net.apply(network, None) if network is not None else None
    ctx = DistContext(rank, local_rank, world_size, device, backend, owns, resolution, scope, device_why=why,
                      timeout_s=cfg.timeout_s)
    if ctx.distributed:
        ctx.side = ctx.new_side_group()
    return ctx


def _create_group(cfg: DistSection, network: NetworkSection | None, backend: str, rank: int,
                  world_size: int) -> tuple[net.Resolution | None, str]:
    """The default process group, made by every rank after the network check: (the network
    resolution or None, the store scope of this attempt)."""
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if "MASTER_ADDR" not in os.environ and "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        raise ConfigError(f"environment WORLD_SIZE={world_size} without MASTER_ADDR/MASTER_PORT: launch with "
                          "torchrun (or set both) so the ranks can find each other")
    store, scope = _elastic_store(timeout)
    if store is None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 29500), world_size,
                              is_master=rank == 0, timeout=timeout)
    resolution = _check_network(network, store, rank, world_size) if network is not None else None
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    return resolution, scope


def teardown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
