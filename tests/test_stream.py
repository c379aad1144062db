"""Streams (trainapp/streams/, trainapp/core/lanes.py, trainapp/core/stream.py): shards dealt to the
global batch's lanes, every item of an epoch read exactly once across resizes and epoch ends, a killed
rank's run bitwise its straight twin's (loader workers or not, JSON Lines or tar), and the stream's bad
input in one line. The stream's 2 -> 1 -> 2 under torchrun's elastic agents is in test_elastic.py; under
Ray, test_ray.py."""

from __future__ import annotations

import collections
import io
import json
import os
import random
import tarfile

import pytest
import torch
import usertasks_stream as us
from helpers import USERTASKS, inspect, metrics, one_error_line, torchrun, trainapp
from torch.utils.data import DataLoader

from trainapp import cli, streams
from trainapp.core.lanes import Deal, Piece
from trainapp.core.items import item_digest
from trainapp.core.lane_reader import LaneReader, Source, keep
from trainapp.snapshots.store import list_snapshots

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(USERTASKS), os.environ.get("PYTHONPATH", "")]),
       "HF_DATASETS_OFFLINE": "1"}
TASK = ["task.name=usertasks_stream:StreamLedger", "train.batch_size=16", "amp.dtype=off",
        "train.progress=false"]
TYPED = ["task.name=usertasks_stream:TypedLedger", *TASK[1:], "task.args.rows=512"]
"""Items that are dicts of 0-dim tensors of several dtypes, a bool mask, a numpy scalar and a string."""


def _read_all(deal: Deal, lengths: list[int]) -> list[tuple[int, int, int]]:
    """(epoch, shard, item) of everything the deal's lanes have left, read to their ends."""
    out = []
    for lane, (index, item, _) in zip(deal.lanes, deal.pos):
        for k, (e, shard, start, _) in enumerate(lane[index:]):
            out += [(e, shard, i) for i in range(item if k == 0 else start, lengths[shard])]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_lanes_redealt_and_carried_read_every_item_of_an_epoch_once(seed):
    """A deal read part-way, re-dealt to another number of lanes, then ended and carried into the next
    epoch: every (epoch, shard, item) once, whatever the cut points."""
    rng = random.Random(seed)
    n, lengths = 13, [rng.randint(1, 40) for _ in range(13)]
    deal = Deal.first(seed, 0, n, 4)
    assert sorted(s for lane in deal.lanes for _, s, _, _ in lane) == list(range(n))
    seen = []
    for rounds in range(3):
        for k, lane in enumerate(deal.lanes):  # each lane reads a few items of its current piece
            index, item, _ = deal.pos[k]
            if index < len(lane):
                take = min(rng.randint(0, 10), lengths[lane[index][1]] - item)
                seen += [(lane[index][0], lane[index][1], i) for i in range(item, item + take)]
                deal.pos[k] = [index, item + take, "digest"]
        deal = deal.redeal(rng.choice([1, 2, 3, 5, 8]))
    rest = _read_all(deal, lengths)
    assert sorted(seen + rest) == [(0, s, i) for s in range(n) for i in range(lengths[s])]
    carried = deal.next_epoch(seed, n)
    assert carried.epoch == 1 and carried.slots == deal.slots
    assert sorted(_read_all(carried, lengths)) == sorted(rest + [(1, s, i) for s in range(n)
                                                                  for i in range(lengths[s])])
    assert Deal.from_state(json.loads(json.dumps(carried.state_dict()))) == carried


def test_a_dry_lanes_remainder_holds_only_the_pieces_that_still_had_items():
    deal = Deal(0, [[Piece(0, 0, 0, None), Piece(0, 1, 0, None), Piece(0, 2, 0, None)],
                    [Piece(0, 3, 0, None), Piece(0, 4, 0, None)]])
    deal.pos = [[0, 7, "d"], [1, 2, "e"]]
    assert deal.remainder() == [Piece(0, 0, 7, "d"), Piece(0, 1, 0, None), Piece(0, 2, 0, None),
                                Piece(0, 4, 2, "e")]
    # Lane 0 ran dry holding items of pieces 0 and 2 (piece 1 was empty); lane 1 had none left.
    assert deal.remainder({0: [0, 2], 1: []}) == [Piece(0, 0, 7, "d"), Piece(0, 2, 0, None)]
    assert [p.epoch for p in deal.next_epoch(0, 5, {0: [0, 2], 1: []}).lanes[0]][:1] == [0]


def test_the_shard_order_is_seeded_per_epoch():
    first = [lane for lane in Deal.first(0, 0, 50, 1).lanes[0]]
    assert first == Deal.first(0, 0, 50, 1).lanes[0]
    assert first != Deal.first(0, 1, 50, 1).lanes[0] and first != Deal.first(1, 0, 50, 1).lanes[0]


def _tar(path, samples):
    with tarfile.open(path, "w") as t:
        for key, parts in samples:
            for ext, raw in parts.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(raw)
                t.addfile(info, io.BytesIO(raw))


def test_the_adapters_open_each_shard_at_its_item(tmp_path):
    for s in range(3):
        (tmp_path / f"{s}.jsonl").write_text("".join(json.dumps({"v": s * 10 + i}) + "\n" for i in range(5)))
        samples = [(f"k{s}{i}", {"txt": f"{s}{i}".encode(), "cls": b"1"}) for i in range(4)]
        _tar(tmp_path / f"{s}.tar", samples)
    lines = streams.jsonl(reversed(list(tmp_path.glob("*.jsonl"))), lambda r: r["v"])
    assert lines.shards() == sorted(str(p) for p in tmp_path.glob("*.jsonl"))  # one order on every rank
    assert list(lines.open(lines.shards()[1], 3)) == [13, 14] and list(lines.open(lines.shards()[2], 5)) == []
    tars = streams.tar(tmp_path.glob("*.tar"))
    assert [x["__key__"] for x in tars.open(tars.shards()[2], 1)] == ["k21", "k22", "k23"]
    assert list(tars.open(tars.shards()[0], 0))[0] == {"__key__": "k00", "txt": b"00", "cls": b"1"}
    assert isinstance(lines, streams.Stream) and streams.is_stream(tars) and not streams.is_stream([1, 2])


def test_a_hugging_face_streaming_dataset_opens_each_file_at_its_item(tmp_path):
    datasets = pytest.importorskip("datasets")
    for s in range(3):
        (tmp_path / f"{s}.jsonl").write_text("".join(json.dumps({"v": s * 10 + i}) + "\n" for i in range(5)))
    ds = datasets.load_dataset("json", data_files=sorted(str(p) for p in tmp_path.glob("*.jsonl")),
                               split="train", streaming=True)
    hf = streams.HuggingFace(ds.map(lambda r: {"v": r["v"] + 100}))
    assert hf.shards() == [0, 1, 2]
    assert [r["v"] for r in hf.open(1, 2)] == [112, 113, 114] and [r["v"] for r in hf.open(2, 0)][:1] == [120]
    with pytest.raises(TypeError, match="not a datasets.IterableDataset"):
        streams.HuggingFace([1, 2])


def test_item_digests_follow_content():
    a = {"x": torch.arange(4.0), "y": [1, "a", b"b"]}
    assert item_digest(a) == item_digest({"y": [1, "a", b"b"], "x": torch.arange(4.0)})
    assert item_digest(a) != item_digest({"x": torch.arange(4.0) + 1, "y": [1, "a", b"b"]})
    assert item_digest(torch.zeros(2, dtype=torch.int32)) != item_digest(torch.zeros(2, dtype=torch.int64))


def _entries(stream, deal, slots, workers, steps, first_step=0):
    source = Source(stream, stream.shards(), 0, True, 0, False)
    reader = LaneReader(source, deal, slots, max(1, workers), first_step, 4, lambda items: items)
    it = iter(DataLoader(reader, batch_size=None, num_workers=workers, collate_fn=keep))
    return [next(it) for _ in range(steps * len(slots))]


def test_loader_workers_read_lanes_of_their_own_in_slot_order(tmp_path):
    """Two slots on one rank, two loader workers: each slot has two lanes and reads them on alternate
    steps, each lane read by one worker only; in one process (the same deal) the entries come in the same
    order with the same positions, and a reader started at a later step from the positions reached goes
    on with the next items."""
    for s in range(8):
        (tmp_path / f"{s}.jsonl").write_text("".join(json.dumps(s * 100 + i) + "\n" for i in range(10 + s)))
    stream = streams.jsonl(tmp_path.glob("*.jsonl"))
    deal = Deal.first(3, 0, 8, 4)  # 2 slots x 2 lanes
    two = _entries(stream, deal, [0, 1], 2, 6)
    assert [e[:2] for e in two] == [("ok", lane) for _ in range(3) for lane in (0, 2, 1, 3)]
    ids = [i for e in two for i in e[2]]
    assert len(ids) == len(set(ids)) == 48
    for lane, pos in {e[1]: e[3] for e in two[:4]}.items():  # the positions after steps 0 and 1
        deal.pos[lane] = pos
    source = Source(stream, stream.shards(), 0, True, 0, False)
    reader = LaneReader(source, deal, [0, 1], 2, 2, 4, lambda items: items)
    again = [e for _, e in zip(range(8), iter(reader))]
    assert [(e[1], e[2]) for e in again] == [(e[1], e[2]) for e in two[4:12]]


def _params_sha(run_dir) -> str:
    return inspect(run_dir)["params_sha256"]


@pytest.mark.slow
def test_a_killed_ranks_stream_run_resumes_bitwise_with_loader_workers_tar_shards_and_hugging_face(tmp_path):
    """Uneven JSON Lines shards (16), 2 ranks, 2 micro-batches each, 2 loader workers per rank (8 lanes):
    the straight run, and the same items from tar shards with rank 1 SIGKILLed at step 13 (torchrun
    restarts the group from step 10), and again through a Hugging Face streaming dataset. Both epochs end
    early (a lane ran dry) and carry the rest; the final parameters are bitwise equal."""
    args = [*TASK, "task.args.lengths=uneven", "task.args.shards=16", "train.grad_accum=2",
            "train.max_steps=200", "train.epochs=2", "snapshot.every_steps=5", "train.log_every=1",
            "data.num_workers=2", "snapshot.memory_every_steps=0"]  # the storage tier's resume
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = torchrun(2, f"run.dir={straight}", *args, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    r = torchrun(2, f"run.dir={killed}", *args, "task.args.fmt=tar", "drill.kill_at_step=13", "drill.rank=1",
                 max_restarts=1, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    starts = metrics(killed, "start")
    assert [s["resumed_step"] for s in starts] == [None, 10], starts
    (end,) = metrics(straight, "end")
    steps = inspect(straight)["global_step"]
    assert 0 < steps < 200 and end["data"]["carried_pieces"] > 0 and end["data"]["dropped_pieces"] > 0, end
    assert inspect(killed)["global_step"] == steps and _params_sha(killed) == _params_sha(straight)
    # What the final model was trained on: every id twice (two epochs), but for what the last epoch left.
    state = torch.load(list_snapshots(straight / "snapshots")[-1] / "state.pt", weights_only=False)["stream"]
    seen = collections.Counter(i for ids in us.trained(killed).values() for i in ids)
    left = collections.Counter(us.left_unread(state, 1024, 16, "uneven", 2))
    assert all(seen[i] + left[i] == 2 for i in range(1024)), (seen, left)
    # The same files read by Hugging Face datasets (streaming=True), killed the same way: the same model.
    hf = tmp_path / "hf"
    r = torchrun(2, f"run.dir={hf}", *args, "task.args.fmt=hf", "drill.kill_at_step=13", "drill.rank=1",
                 max_restarts=1, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    assert [s["resumed_step"] for s in metrics(hf, "start")] == [None, 10]
    assert _params_sha(hf) == _params_sha(straight)


@pytest.mark.slow
def test_a_stream_resized_2_1_2_with_a_rescaled_global_batch_reads_every_item_once(tmp_path):
    """`train.on_resize=rescale`: 2 ranks (4 lanes), rank 1 killed at step 9; 1 rank resumes (2 lanes: the
    unread rest of the 4 dealt to 2), killed at step 20 (resumed from 16); 2 ranks again (4 lanes) to the
    end of 2 epochs.
    Every id is trained once per epoch, but for what the last epoch left unread."""
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TASK, "task.args.lengths=uneven", "train.grad_accum=2", "train.max_steps=300",
            "train.epochs=2", "snapshot.every_steps=4", "train.on_resize=rescale", "train.log_every=1"]
    r = torchrun(2, *args, "drill.kill_at_step=9", "drill.rank=1", env=ENV)
    assert r.returncode != 0
    r = trainapp("train", *args, "drill.kill_at_step=20", "drill.rank=0", env=ENV)
    assert r.returncode != 0
    r = torchrun(2, *args, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    starts = metrics(run, "start")
    assert [(s["world_size"], s["global_batch"], s["resumed_step"]) for s in starts] == \
        [(2, 64, None), (1, 32, 8), (2, 64, 16)], starts
    (end,) = metrics(run, "end")
    assert end["data"]["resized"] == 2, end
    state = torch.load(list_snapshots(run / "snapshots")[-1] / "state.pt", weights_only=False)["stream"]
    seen = collections.Counter(i for ids in us.trained(run).values() for i in ids)
    left = collections.Counter(us.left_unread(state, 1024, 8, "uneven", 2))
    assert all(seen[i] + left[i] == 2 for i in range(1024)), (seen, left)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["too few shards", "no max_steps"])
def test_a_stream_that_cannot_train_is_one_line_before_training(tmp_path, case):
    extra = {"too few shards": ["task.args.shards=3", "train.grad_accum=4", "train.max_steps=10"],
             "no max_steps": []}[case]
    r = trainapp("train", f"run.dir={tmp_path}", *TASK, *extra, env=ENV)
    needle = {"too few shards": "the train stream has 3 shard(s), and each of the global batch's 4 micro",
              "no max_steps": "train.max_steps is not set"}[case]
    one_error_line(r, "train", needle)
    assert not list(tmp_path.glob("snapshots/step_*"))


@pytest.mark.slow
def test_shards_listed_differently_on_two_ranks_are_one_line_before_training(tmp_path):
    r = torchrun(2, f"run.dir={tmp_path}", *TASK, "train.max_steps=10", "task.args.fault=unsorted", env=ENV)
    # torchrun adds a traceback of its own for the failed child; trainapp's line is the same on every rank.
    lines = {line for line in r.output.splitlines() if line.startswith("trainapp train: error:")}
    assert len(lines) == 1 and "the train stream's shards() differ between ranks" in lines.pop(), r.output
    assert "exitcode  : 2" in r.output and not list(tmp_path.glob("snapshots/step_*"))


@pytest.mark.slow
def test_an_open_that_ignores_start_is_found_at_the_first_resume(tmp_path):
    args = [f"run.dir={tmp_path}", *TASK, "task.args.fault=ignore_start", "train.max_steps=30",
            "snapshot.every_steps=5"]
    r = trainapp("train", *args, "drill.kill_at_step=7", env=ENV)
    assert r.returncode != 0 and list_snapshots(tmp_path / "snapshots")
    r = trainapp("train", *args, env=ENV)
    one_error_line(r, "train", "gave an item other than item")


@pytest.mark.slow
def test_a_shard_that_stays_broken_ends_the_run_named_or_is_skipped_when_allowed(tmp_path):
    args = [*TASK, "train.max_steps=40", "data.shard_retries=1"]
    r = trainapp("train", f"run.dir={tmp_path / 'broken'}", *args, "task.args.fault=broken:3", env=ENV)
    assert r.returncode == 1
    (failure,) = metrics(tmp_path / "broken", "failure")
    assert "shard-0003.jsonl" in failure["error"] and "failed 2 time(s)" in failure["error"], failure
    assert "data.skip_bad_shards=true" in failure["error"], failure
    r = trainapp("train", f"run.dir={tmp_path / 'skipped'}", *args, "task.args.fault=broken:3",
                 "data.skip_bad_shards=true", env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    assert metrics(tmp_path / "skipped", "end")[0]["data"]["skipped_shards"] == 1
    assert "skipped the rest of a shard (data.skip_bad_shards)" in r.output
    # A shard that fails twice and then opens: retried (data.shard_retries=2), nothing skipped.
    r = trainapp("train", f"run.dir={tmp_path / 'flaky'}", *TASK, "train.max_steps=40",
                 "task.args.fault=flaky:3", env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    assert metrics(tmp_path / "flaky", "end")[0]["data"]["skipped_shards"] == 0


@pytest.mark.slow
def test_typed_items_from_tensor_shards_killed_and_restarted_are_bitwise_their_straight_twin(tmp_path):
    """2 ranks on tensor shards of typed items (0-dim int64, bfloat16, float16, int8 and bool tensors, a bool
    mask, a numpy float32, a string): straight, and rank 1 SIGKILLed at step 8, the group restarted from its
    copy of step 7 in memory (each lane's position from every rank's copy, each lane reopened after a
    re-read item whose digest must match): bitwise equal."""
    args = [*TYPED, "task.args.fmt=tensors", "train.max_steps=12", "snapshot.every_steps=5",
            "train.log_every=4", "snapshot.memory_every_steps=1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = torchrun(2, f"run.dir={straight}", *args, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    r = torchrun(2, f"run.dir={killed}", *args, "drill.kill_at_step=8", "drill.rank=1", max_restarts=1,
                 env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    assert [(s["resumed_step"], s["resumed_tier"]) for s in metrics(killed, "start")] == [(None, None),
                                                                                        (7, "memory")]
    assert _params_sha(killed) == _params_sha(straight)


@pytest.mark.slow
def test_typed_items_of_a_2_rank_run_that_died_are_each_trained_once_by_one_rank_resuming_it(tmp_path):
    """The same items as JSON Lines decoded by the task (the stream whose 0-dim labels crashed the resume
    check): 2 ranks, rank 1 SIGKILLed at step 7 and the group gone; the run resumed alone from the snapshot at
    5 (its lanes kept: the same global batch) to the epoch's end: every item of the epoch trained once."""
    run = tmp_path / "run"
    args = [f"run.dir={run}", *TYPED, "train.max_steps=100", "train.epochs=1", "snapshot.every_steps=5",
            "train.log_every=4"]
    r = torchrun(2, *args, "drill.kill_at_step=7", "drill.rank=1", env=ENV)
    assert r.returncode != 0
    r = trainapp("train", *args, env=ENV)
    assert r.returncode == 0, r.output[-3000:]
    starts = metrics(run, "start")
    assert [(s["world_size"], s["resumed_step"]) for s in starts] == [(2, None), (1, 5)], starts
    ledger = us.epochs_once(run, 512, 16)  # 8 shards of 64 over 2 lanes: 16 steps of 32 items
    assert ledger == {"steps": list(range(1, 17)), "sizes": {32}, "bad_epochs": []}, ledger


SHARD = "of the train stream's shard '{run}/shards/shard-000"


@pytest.mark.parametrize("bad,extra,needles", [
    ("none:3", [], [f"item 3 {SHARD}", f".jsonl' at ['y'] is a NoneType where item 0 {SHARD}",
                    "which the default collate cannot batch; change the item, or give the task a collate"]),
    ("nokey:3", ["data.num_workers=1"], [".jsonl' is a mapping without the key 'mask' that item 0 of the"]),
    ("shape:3", [], [f"at ['x'] is a float32 tensor of shape (9,) where item 0 {SHARD}"]),
    ("none:3", ["task.args.map_style=true"], ["of the train set at ['y'] is a NoneType"]),
    ("none:3", ["task.args.map_style=true", "data.num_workers=1"], ["of the train set at ['y'] is a None"]),
])
def test_an_item_the_collate_cannot_batch_is_one_line_naming_where_it_is(capsys, tmp_path, monkeypatch, bad,
                                                                          extra, needles):
    """In this process (trainapp's CLI entry, its real exit code and stderr): a stream's item or a map-style
    item that torch's default collate cannot batch, read here or in a loader worker."""
    monkeypatch.syspath_prepend(str(USERTASKS))
    run = tmp_path / "run"
    code = cli.main(["train", f"run.dir={run}", *TYPED, "train.max_steps=4", f"task.args.bad={bad}", *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("trainapp train: error: ")]
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert all(needle.format(run=run) in lines[0] for needle in needles), lines[0]
    assert "Traceback" not in err and not list(run.glob("snapshots/step_*"))
