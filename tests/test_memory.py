"""The memory tier of snapshots (trainapp/snapshots/memory.py, memory_slots.py): a rank's share of the state
in two slot files in a tmpfs, never read torn; the ranks' agreement on the step to resume and where each
rank's copy comes from; and under torchrun, a SIGKILLed rank's run resumed from memory (one step redone at
most, no storage read) bitwise equal to its straight twin, a kill in the middle of a copy, a memory tier
wiped between attempts (storage resumes it, said so), a finished run's copies gone, and a memory
directory that cannot hold the tier one line before the first step."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
import torch
from helpers import (FAULT_RUN, FSDP_RUN, RDZV_CONF, REPO, TORCHRUN, inspect, metrics, run_cmd, torchrun,
                     torchrun2, wait_for_record)

from trainapp import cli
from trainapp.snapshots import memory_slots as slots
from trainapp.snapshots.memory import Copy, MemoryTier, _choose, unusable
from helpers import free_port

MEMORY = ["snapshot.memory_every_steps=1"]


@pytest.fixture
def shm(tmp_path):
    """A memory directory of the test's own in /dev/shm (a tmpfs), removed after."""
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="ta-test-mem-", dir="/dev/shm"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _slot_state(seed: int) -> dict:
    """A state with every kind of item a memory slot carries (float, bf16, empty and 0-d tensors, a tuple
    like Python's generator state, bytes; a module's state dict, whose `_metadata` holds the versions its
    loading migrates old keys by; a task's Counter and defaultdict), drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).state_dict()
    return {"model": {"w": torch.randn(300, 300, generator=g), "b": torch.zeros(0),
                      "h": torch.randn(7, generator=g).to(torch.bfloat16), "n": torch.tensor(seed)},
            "ema": module,
            "task": {"seen": collections.Counter(a=seed),
                     "by_len": collections.defaultdict(list, {3: [seed]})},
            "rng": {"python": (3, tuple(range(seed, seed + 5)), None), "numpy": b"\x00\x01"},
            "progress": {"global_step": seed}}


def _equal(a, b) -> bool:
    """The same values in containers of the same kind (a state dict's `_metadata`, a defaultdict's
    factory): what torch.save and torch.load give back, so a resume from memory loads as one from storage."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (type(a) is type(b) and getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
                and getattr(a, "default_factory", None) is getattr(b, "default_factory", None)
                and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_a_slot_reads_back_what_was_written_and_a_changed_byte_fails_its_check(shm):
    state = _slot_state(3)
    slots.write(shm / "own-00000.0", state, seq=3, step=3)
    head = slots.header(shm / "own-00000.0")
    assert head is not None and (head.seq, head.step) == (3, 3)
    data = slots.read_bytes(head)
    assert data is not None and _equal(slots.decode(data), state)
    torn = bytearray(data)
    torn[-5] ^= 1
    assert not slots.check(bytes(torn))


Pair = collections.namedtuple("Pair", "a b")


def test_a_slot_keeps_its_views_while_the_layout_holds_and_reads_back_any_layout(shm):
    """Tensors in any layout and of any kind (transposed, channels_last, in a named tuple, one met twice,
    int, bool, complex, bfloat16, 0-dim, empty, a parameter, one that requires grad): read back equal and
    of the same kind, as torch.load gives them back. A slot written again with the same dtypes and shapes
    keeps its mapping; one whose shapes change, or whose pickled part outgrows the slot's room, is remade
    and reads back."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, generator=g)
    conv = torch.randn(4, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)

    def state(step: int, rows: int = 5, note: str = "") -> dict:
        shared = torch.arange(6) * step
        return {"t": w.t() * step, "conv": conv * step, "again": shared, "step": step, "note": note,
                "pair": Pair(torch.ones(2, dtype=torch.bool), shared), "z": torch.full((3,), 1 + 2j) * step,
                "rows": torch.randn(rows, 2, generator=g), "scalar": torch.tensor(step / 3),
                "bf16": w.bfloat16() * step, "empty": torch.empty(0, 4),
                "param": torch.nn.Parameter(w[0] * step),
                "frozen": torch.nn.Parameter(w[1], requires_grad=False),
                "temperature": torch.full((), 0.5 * step, requires_grad=True)}

    slot = slots.SlotFile(shm / "own-00000.0")
    try:
        for step, kwargs in enumerate([{}, {}, {"rows": 9}, {"note": "x" * (2 * slots.SLACK)}], start=1):
            mapping = slot.map
            want = state(step, **kwargs)
            head = slot.write(want, seq=step, step=step)
            assert (slot.map is mapping) == (step == 2), step  # kept only while the layout held and fitted
            data = slots.read_raw(head.path)  # what a restart reads: the slot's bytes, not the file's room
            assert slots.check(data) and data == slots.read_bytes(head)
            got = slots.decode(data)
            assert _equal(got, want) and type(got["pair"]) is Pair
            assert got["again"] is got["pair"].b  # one tensor met twice is one tensor read back
            assert got["t"].is_contiguous() and torch.equal(got["conv"], conv * step)
            assert type(got["param"]) is torch.nn.Parameter and got["param"].requires_grad
            assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad
            assert got["temperature"].requires_grad and not got["scalar"].requires_grad
            assert got["scalar"].dim() == 0 and got["empty"].shape == (0, 4)
    finally:
        slot.close()


def _writer(path_base: Path, kill_at: int) -> None:
    """A process that writes states 1, 2, ... into two alternating slots and SIGKILLs itself halfway
    through the write of state `kill_at`."""
    for seq in range(1, kill_at + 1):
        midway = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if seq == kill_at else None
        slots.write(Path(f"{path_base}.{seq % 2}"), _slot_state(seq), seq=seq, step=seq, midway=midway)


@pytest.mark.parametrize("kill_at", [1, 2, 5])
def test_a_copy_a_sigkill_interrupted_is_never_read(shm, kill_at):
    """A real SIGKILL halfway through a slot's write: the owner's newest committed slot is the copy before
    (none before the first), whole and checked."""
    base = shm / "own-00000"
    tests = Path(__file__).parent
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); from pathlib import Path; "
            f"from test_memory import _writer; _writer(Path({str(base)!r}), {kill_at})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    torn = slots.header(Path(f"{base}.{kill_at % 2}"))
    assert torn is None  # the slot being written says it is not whole
    newest = slots.newest([Path(f"{base}.0"), Path(f"{base}.1")])
    if kill_at == 1:
        assert newest is None
        return
    assert newest is not None and newest.seq == kill_at - 1
    data = slots.read_bytes(newest)
    assert data is not None and _equal(slots.decode(data), _slot_state(kill_at - 1))


def _copies(*entries) -> list[Copy]:
    return [Copy(kind, owner, step, step, 0, f"/{kind}-{owner}.{step}") for kind, owner, step in entries]


def test_the_ranks_agree_on_the_newest_step_every_rank_has_somewhere():
    a = ("A", _copies(("own", 0, 11), ("own", 0, 12), ("own", 1, 11), ("own", 1, 12)))
    b = ("B", _copies(("own", 2, 12), ("own", 2, 11), ("peer", 0, 12), ("peer", 1, 12)))
    c = ("B", [])
    # Rank 3 (on node B) has no copy of 12 anywhere: 11 is not there for it either.
    step, _ = _choose([a, a, b, c], 4, None)
    assert step is None
    # Three ranks: node A (ranks 0, 1), node B (rank 2) holding peers of 0 and 1.
    step, plan = _choose([a, a, b], 3, None)
    assert step == 12 and [(o, h, tier) for o, h, _, tier in plan] == [(0, 0, "memory"), (1, 1, "memory"),
                                                                      (2, 2, "memory")]
    # Node A lost its memory (a new node id, no copies): ranks 0 and 1 get theirs from node B's rank 2.
    lost = ("A2", [])
    step, plan = _choose([lost, lost, b], 3, None)
    assert step == 12 and [(o, h, tier) for o, h, _, tier in plan] == [(0, 2, "peer"), (1, 2, "peer"),
                                                                      (2, 2, "memory")]
    # Storage holds a newer step than memory: storage resumes.
    assert _choose([a, a, b], 3, 13)[0] is None
    assert _choose([a, a, b], 3, 12)[0] == 12


def test_a_run_folder_deleted_under_a_rank_is_made_again_and_the_copy_goes_on(shm, caplog):
    """Something outside the run (a /dev/shm wiped by hand, a cleaner) deletes the run's folder before a
    rank's first copy: the copy is made, one warning says so, and it is read back. (Seen once with two
    suites side by side: a rank's first copy ended the run with FileNotFoundError.)"""
    import shutil

    tier = MemoryTier(shm, "wiped", 0, 1, 1)
    tier.root.mkdir()  # as `sized` makes it, once the tier is kept
    shutil.rmtree(tier.root)
    with caplog.at_level("WARNING", logger="trainapp"):
        tier._write(3, {"x": torch.arange(4)})
    assert [c.step for c in tier.inventory()] == [3]
    assert f"{tier.root} was deleted while the run used it; made again" in caplog.text


def test_a_memory_directory_that_cannot_hold_the_tier_is_named(tmp_path, shm):
    assert unusable(shm, made_here=False) is None
    assert "does not exist" in unusable(tmp_path / "nope", made_here=False)
    assert "not a memory filesystem" in unusable(tmp_path, made_here=False)  # the disk under the tests


def test_a_memory_tier_that_does_not_fit_is_one_line_before_the_first_step(capsys, tmp_path, small_tmpfs):
    run = tmp_path / "run"
    code = cli.main(["train", f"run.dir={run}", "train.max_steps=3", "train.progress=false", *MEMORY,
                     f"snapshot.memory_dir={small_tmpfs}", "data.train_size=256", "data.val_size=64"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trainapp train: error: ")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert f"snapshot.memory_every_steps=1: {small_tmpfs} has 0.1 MiB free on node" in lines[0], lines[0]
    assert "docker run --shm-size" in lines[0] and "Traceback" not in err
    assert not list(run.glob("snapshots/step_*"))
    assert not list(small_tmpfs.glob("run-*"))  # a run that never stepped leaves no folder there
    # auto: the same directory turns the tier off, with one warning line, and the run trains.
    code = cli.main(["train", f"run.dir={tmp_path / 'auto'}", "train.max_steps=3", "train.progress=false",
                     "snapshot.memory_every_steps=auto", f"snapshot.memory_dir={small_tmpfs}",
                     "data.train_size=256", "data.val_size=64"])
    err = capsys.readouterr().err
    assert code == 0 and "snapshot.memory_every_steps=auto: the memory tier is off:" in err, err[-3000:]
    assert not list(small_tmpfs.glob("run-*"))


@pytest.mark.slow
def test_a_rank_sigkilled_in_the_middle_of_its_copy_resumes_from_the_copy_before_bitwise(
        tmp_path, torchrun_straight, shm):
    """FAULT_RUN (snapshots on storage every 5 steps) with a memory copy every step: rank 1 SIGKILLs itself
    halfway through its copy of step 13 (a torn slot). The group restarted by torchrun resumes step 12 from
    memory (one step redone), not the storage snapshot of step 10, and not the torn copy; the final
    parameters equal the run nobody killed. The finished run leaves no copy in the memory directory.
    (A kill before the copy starts: test_fsdp_shards_... below, tests/test_stream.py's typed items.)"""
    run = tmp_path / "run"
    r = run_cmd(torchrun2(run, *FAULT_RUN, *MEMORY, f"snapshot.memory_dir={shm}",
                          "drill.kill_in_memory_copy_at_step=13", "drill.rank=1"), timeout=600)
    assert r.returncode == 0, r.output[-3000:]
    assert "kills itself with SIGKILL halfway through its memory copy of step 13" in r.output
    starts = metrics(run, "start")
    assert [(s["resumed_step"], s["resumed_tier"]) for s in starts] == [(None, None), (12, "memory")], starts
    assert inspect(run)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]
    assert sorted(p.name for p in shm.iterdir()) == ["node-id"]
    r = run_cmd([sys.executable, "-m", "trainapp", "report", str(run), "--out", str(tmp_path / "r.png")])
    restart = "restarts       1: resumed at 12 from memory after 13 (1 redone, world size 2)"
    assert restart in r.stdout, r.output


@pytest.mark.slow
def test_a_memory_tier_wiped_between_attempts_falls_back_to_storage(tmp_path, torchrun_straight, shm):
    run = tmp_path / "run"
    args = [*FAULT_RUN, *MEMORY, f"snapshot.memory_dir={shm}"]
    r = torchrun(2, f"run.dir={run}", *args, "drill.kill_at_step=13", "drill.rank=1")
    assert r.returncode != 0
    assert any(p.name.startswith("run-") for p in shm.iterdir())
    for p in shm.iterdir():  # the node's memory lost (a reboot), its disk kept
        if p.is_dir():
            import shutil

            shutil.rmtree(p)
    r = torchrun(2, f"run.dir={run}", *args, "drill.kill_at_step=13", "drill.rank=1")
    assert r.returncode == 0, r.output[-3000:]
    starts = metrics(run, "start")
    assert [(s["resumed_step"], s["resumed_tier"]) for s in starts] == [(None, None), (10, "storage")], starts
    assert inspect(run)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]


def _host_agent(host, port: int, run_dir: Path, log: Path, *args: str) -> subprocess.Popen:
    """One torchrun agent on `host` (its own network namespace and its own /dev/shm): a node of a 2-node
    job whose rendezvous is on host-a."""
    cmd = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={netns.TRAIN_NET}.1:{port}", "--rdzv-id=memory", RDZV_CONF,
           "--max-restarts=3", "-m", "trainapp", "train", f"run.dir={run_dir}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out = open(log, "ab")  # noqa: SIM115 (the child writes it; closed when the test ends)
    return subprocess.Popen(host.prefix(memory="256m") + cmd, cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_a_lost_node_resumes_from_its_buddys_copy_bitwise(tmp_path, torchrun_straight):
    """Two hosts (network namespaces, each with its own /dev/shm), one rank each, a memory copy every step
    sent to the buddy on the other host, no storage snapshot before the end: host-b's processes SIGKILLed
    (its /dev/shm goes with them, as a lost node's memory), then host-b back with empty memory. The group
    resumes from the newest step in memory, host-b's rank from host-a's copy of it (`peer`), and ends
    bitwise equal to the run nobody killed."""
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    hosts = netns.TwoHosts().up()
    agents: list[subprocess.Popen] = []
    try:
        run, port = tmp_path / "run", free_port()
        args = [*FAULT_RUN, "snapshot.every_steps=100", *MEMORY, "network.interface=trn0",
                "drill.slow_rank=0", "drill.slow_ms=250"]
        agents.append(_host_agent(hosts.a, port, run, tmp_path / "a.log", *args))
        time.sleep(3)  # host-a's agent holds the rendezvous store (a stable node's, as in a cluster)
        agents.append(_host_agent(hosts.b, port, run, tmp_path / "b.log", *args))
        wait_for_record(run, "train", lambda r: r["step"] >= 8)
        assert hosts.b.kill_all() >= 2  # host-b lost: its agent, its rank and with them its memory
        agents[1].wait(timeout=60)
        agents.append(_host_agent(hosts.b, port, run, tmp_path / "b2.log", *args))
        assert agents[0].wait(timeout=300) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert agents[2].wait(timeout=60) == 0, (tmp_path / "b2.log").read_text()[-3000:]
        starts = metrics(run, "start")
        assert len(starts) == 2 and starts[1]["resumed_tier"] == "peer", starts
        assert sorted(starts[1]["resumed_tiers"]) == ["memory", "peer"], starts[1]
        assert starts[1]["resumed_step"] >= 8 and starts[1]["world_size"] == 2, starts[1]
        # Only the final snapshot on storage: there was nothing to read there.
        assert [p.name for p in (run / "snapshots").glob("step_*")] == ["step_000000024"]
        assert inspect(run)["params_sha256"] == inspect(torchrun_straight)["params_sha256"]
    finally:
        for host in (hosts.a, hosts.b):
            host.kill_all()
        hosts.down()


@pytest.mark.slow
def test_fsdp_shards_resume_from_memory_and_another_world_size_from_storage(tmp_path, fsdp_straight, shm):
    """FSDP (every rank's shards of the model, optimizer and EMA in its memory copy): rank 1 SIGKILLed after
    step 13, resumed from memory at step 12 to the parameters of the FSDP run nobody killed (the copies
    every step change nothing: sizing the tier before the first step makes no optimizer state, which
    DCP would make by an optimizer step). The same run's copies at another world size (one process
    resuming it) are not used: storage resumes it, and the start record says why."""
    run = tmp_path / "run"
    args = [*FSDP_RUN, *MEMORY, f"snapshot.memory_dir={shm}"]
    r = run_cmd(torchrun2(run, *args, "drill.kill_at_step=13", "drill.rank=1"), timeout=600)
    assert r.returncode == 0, r.output[-3000:]
    starts = metrics(run, "start")
    assert [(s["resumed_step"], s["resumed_tier"]) for s in starts] == [(None, None), (12, "memory")], starts
    assert inspect(run)["params_sha256"] == inspect(fsdp_straight)["params_sha256"]
    # At another world size: 2 ranks stopped at step 17 (copies in memory), 1 process resumes.
    resized = tmp_path / "resized"
    r = torchrun(2, f"run.dir={resized}", *args, "drill.kill_at_step=17", "drill.rank=1")
    assert r.returncode != 0
    r = torchrun(1, f"run.dir={resized}", *args)
    assert r.returncode == 0, r.output[-3000:]
    start = metrics(resized, "start")[-1]
    assert (start["resumed_step"], start["resumed_tier"], start["world_size"]) == (15, "storage", 1), start
    assert "is of world size 2, this run's is 1" in start["resumed_note"], start


def test_another_runs_copies_untouched_for_a_day_are_deleted_at_a_start(shm):
    from trainapp.snapshots.memory import STALE_S, _prune

    old, fresh = shm / "run-old", shm / "run-fresh"
    for run in (old, fresh):
        run.mkdir()
        (run / "own-00000.0").write_bytes(b"x")
    long_ago = time.time() - STALE_S - 60
    for p in (old, old / "own-00000.0"):
        os.utime(p, (long_ago, long_ago))
    _prune(shm, time.time() - STALE_S)
    assert not old.exists() and fresh.exists()


def test_a_copied_run_directory_gets_its_own_memory_id_and_a_moved_one_keeps_it(tmp_path):
    """`cp -r` of a run directory while the original is there (an experiment forked from a run's
    snapshots): the copy's copies in memory must not be the original's, which a shared id would make them
    (the same memory folder). A moved directory is the same run: its id is kept."""
    import shutil

    from trainapp.snapshots.memory import run_id

    first = run_id(str(tmp_path / "a"))
    assert run_id(str(tmp_path / "a")) == first  # every start of the run
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copied = run_id(str(tmp_path / "b"))
    assert copied != first and run_id(str(tmp_path / "b")) == copied and run_id(str(tmp_path / "a")) == first
    (tmp_path / "a").rename(tmp_path / "c")
    assert run_id(str(tmp_path / "c")) == first
    (tmp_path / "legacy").mkdir()  # a file of one line, as runs before this change wrote it
    (tmp_path / "legacy" / "memory-id").write_text("0123456789abcdef")
    assert run_id(str(tmp_path / "legacy")) == "0123456789abcdef"
