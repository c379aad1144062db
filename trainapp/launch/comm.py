"""`trainapp doctor --comm`: all-reduce bandwidth between every pair of nodes, over the interface
training would use, before a long job finds a slow link the hard way.

Run it the way training runs, one process per node at least: under torchrun (`torchrun --nnodes=N
... -m trainapp doctor --comm network.interface=...`) or as a Ray job (`ray job submit -- python -m
trainapp doctor --comm ray.num_workers=N`, where Ray Train starts the processes as for training:
trainapp/launch/ray/driver.py). Every process sets up distributed exactly as training does (the same interface
resolution and check, Gloo on CPU, NCCL on GPUs); the ranks are grouped by node, and for each pair of
nodes the first rank of each runs a short all-reduce between the two of them (a two-rank group, one
pair at a time, the others waiting). Rank 0 prints the bus bandwidth
per pair and names what is slow:

- a pair below `--min-bandwidth` (GB/s);
- with three or more nodes, a host whose pairs' median is under half the median over hosts (its link),
  and a pair under half of what its two hosts reach with the others (the path between them).

Exit 0 when nothing is slow, 1 when something is (every rank, so the launcher reports the failure).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from trainapp.config import ConfigError, DistSection, NetworkSection
from trainapp.launch import dist


@dataclass
class Pair:
    a: str
    b: str
    seconds: float
    """Median seconds of one all-reduce of `nbytes`."""
    nbytes: int

    @property
    def busbw(self) -> float:
        """Bus bandwidth in GB/s, as nccl-tests count it: algorithm bandwidth x 2(n-1)/n, which is the
        algorithm bandwidth itself for two ranks."""
        return self.nbytes / self.seconds / 1e9


def _time_all_reduce(ctx: dist.DistContext, group: tdist.ProcessGroup, nbytes: int, iters: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    tdist.all_reduce(x, group=group)  # warm-up: connections, buffers
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        tdist.all_reduce(x, group=group)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(ctx: dist.DistContext, nbytes: int, iters: int) -> tuple[list[str], list[Pair]]:
    """Every rank: (the nodes in order of their first rank, the pairs measured between them)."""
    where = dist.placement(ctx)
    keys = ctx.all_gather_objects((where["host"], where["node_rank"]))  # node rank: hosts may share a name
    order = list(dict.fromkeys(keys))
    leaders = [keys.index(k) for k in order]
    hosts = [h for h, _ in order]
    nodes = [h if hosts.count(h) == 1 else f"{h}#node{n}" for h, n in order]
    mine: list[Pair] = []
    for (i, a), (j, b) in itertools.combinations(enumerate(nodes), 2):
        members = [leaders[i], leaders[j]]
        group = tdist.new_group(members)  # every rank takes part in creating every group
        if ctx.rank in members:
            assert isinstance(group, tdist.ProcessGroup)  # a member gets the group, not NON_GROUP_MEMBER
            seconds = _time_all_reduce(ctx, group, nbytes, iters)
            if ctx.rank == members[0]:
                mine.append(Pair(a, b, seconds, nbytes))
        tdist.barrier()  # one pair at a time: pairs that share nothing could still share a switch
        tdist.destroy_process_group(group)
    pairs = [p for per_rank in ctx.all_gather_objects(mine) for p in per_rank]
    return nodes, pairs


def judge(nodes: list[str], pairs: list[Pair], min_bandwidth: float) -> tuple[list[str], list[str]]:
    """(one line per pair, one line per problem).

    With three or more nodes each host gets the median bandwidth of its pairs: a host under half the
    median over hosts is slow (its link), and so is a pair under half the smaller median of its two
    hosts (the path between them). Comparing pairs with the median of all pairs would miss a slow
    host among three nodes, two of whose three pairs are slow. Any pair below `min_bandwidth` is slow,
    and a host all of whose pairs are is named."""
    per_host = {h: [p.busbw for p in pairs if h in (p.a, p.b)] for h in nodes}
    host_bw = {h: statistics.median(v) for h, v in per_host.items() if v}
    relative = len(nodes) >= 3 and host_bw
    typical = statistics.median(host_bw.values()) if host_bw else 0.0
    slow_hosts = [h for h in nodes if relative and host_bw[h] < typical / 2]
    slow_pairs, lines = [], []
    for p in pairs:
        why = []
        if min_bandwidth and p.busbw < min_bandwidth:
            why.append(f"below --min-bandwidth {min_bandwidth:g} GB/s")
        if relative and p.busbw < min(host_bw[p.a], host_bw[p.b]) / 2:
            why.append(f"under half of what {p.a} and {p.b} reach with others")
        if p.a in slow_hosts or p.b in slow_hosts:
            why.append(f"{p.a if p.a in slow_hosts else p.b} is slow")
        if why:
            slow_pairs.append(p)
        lines.append(f"pair  {p.a} <-> {p.b}  {p.busbw:8.3f} GB/s  ({p.seconds * 1000:.1f} ms per "
                     f"{p.nbytes / 2**20:g} MiB all-reduce)" + (f"  SLOW: {'; '.join(why)}" if why else ""))
    if min_bandwidth and len(nodes) >= 3:
        slow_hosts += [h for h in nodes if h not in slow_hosts and per_host[h]
                       and all(bw < min_bandwidth for bw in per_host[h])]
    problems = [f"host {h}: its pairs reach a median {host_bw[h]:.3f} GB/s against "
                f"{typical:.3f} GB/s over hosts"
                + (f" (--min-bandwidth {min_bandwidth:g})"
                   if min_bandwidth and host_bw[h] < min_bandwidth else "")
                + "; check its link: the interface in network.interface, its speed and duplex, cabling, "
                  "a traffic shaper"
                for h in slow_hosts]
    problems += [f"pair {p.a} <-> {p.b}: {p.busbw:.3f} GB/s; check the path between them"
                 for p in slow_pairs if p.a not in slow_hosts and p.b not in slow_hosts]
    return lines, problems


def check_args(size_mb: float, iters: int, min_bandwidth: float) -> None:
    if size_mb <= 0 or iters < 1 or min_bandwidth < 0:
        raise ConfigError(f"doctor --comm: --size-mb={size_mb:g}, --iters={iters}, "
                          f"--min-bandwidth={min_bandwidth:g}: need a size > 0, at least 1 iteration and a "
                          "bandwidth >= 0")


def show(backend: str, processes: int, via: str, nodes: list[str], pairs: list[Pair],
         min_bandwidth: float) -> int:
    """Print the result (rank 0, or the Ray driver); the exit code: 1 when something is slow."""
    lines, problems = judge(nodes, pairs, min_bandwidth)
    print(f"comm  {backend} across {len(nodes)} node(s) ({', '.join(nodes)}), {processes} process(es); "
          f"rank 0 {via}")
    if len(nodes) < 2:
        print("comm  one node: no node pairs to measure")
    for line in lines:
        print(line)
    for problem in problems:
        print(f"FAIL  comm  {problem}")
    print(f"doctor --comm: {len(problems)} problem(s)" if problems else
          f"doctor --comm: no problems ({len(pairs)} node pair(s))", flush=True)
    return 1 if problems else 0


def main(dist_cfg: DistSection, network: NetworkSection, size_mb: float, iters: int,
         min_bandwidth: float) -> int:
    """Under torchrun (or alone): every rank measures, rank 0 prints, every rank returns the verdict."""
    check_args(size_mb, iters, min_bandwidth)
    ctx = dist.setup(dist_cfg, network)
    try:
        if not ctx.distributed:
            print("comm  one process: nothing to measure; run it under torchrun with one process per node "
                  "(torchrun --nnodes=N ... -m trainapp doctor --comm)")
            return 0
        nodes, pairs = measure(ctx, int(size_mb * 2**20), iters)
        if ctx.is_main:
            via = ctx.network.summary() if ctx.network else "the default interface"
            assert ctx.backend is not None  # a group of more than one rank always has a backend
            return show(ctx.backend, ctx.world_size, via, nodes, pairs, min_bandwidth)
        return 1 if judge(nodes, pairs, min_bandwidth)[1] else 0
    finally:
        dist.teardown(ctx)
