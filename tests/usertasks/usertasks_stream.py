"""A user's task whose training data is a stream of shards (trainapp/streams/): JSON Lines files or
WebDataset-style tar files written under RUN_DIR/shards by rank 0. Its items carry an id; its loss writes
the sample ledger as usertasks_ledger's does (the same model: dropout and BatchNorm), so tests can count
what every step trained (tests/test_stream.py, bench/stream.py).

`fmt`: "jsonl", "tar", "hf" (the JSON Lines files read by Hugging Face `datasets` with streaming=True), or
"tensors" (tensor shards: trainapp.streams.write_tensor_shards, one per JSON Lines file, the typed items).
`items` (StreamLedger's "tuple"; TypedLedger's "typed"): "typed" items are dicts of 0-dim tensors of several
dtypes, a bool mask, a numpy scalar and a string (`typed`), the commonest items a Dataset returns.
`lengths`: the shards' lengths ("equal": `rows` split evenly; "uneven": lengths that differ by up to 3x).
`fault`: "ignore_start" (an `open` that starts every shard at its first item whatever `start` says),
"broken:N" (shard N fails to open every time), "flaky:N" (shard N fails its first two opens), "unsorted"
(every rank but rank 0 lists the shards in reverse).
"""

from __future__ import annotations

import functools
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import torch
from usertasks_ledger import Ledger

from trainapp import streams


def lengths_of(rows: int, shards: int, lengths: str) -> list[int]:
    if lengths == "equal":
        return [rows // shards] * shards
    weights = [1 + (i * 7) % 5 for i in range(shards)]  # 1..5, a fixed pattern
    out = [max(1, rows * w // sum(weights)) for w in weights]
    out[0] += rows - sum(out)
    return out


def write_shards(folder: Path, seed: int, rows: int, shards: int, lengths: str, fmt: str) -> list[Path]:
    """The shards' files (ids 0 .. rows-1 in shard order), written once."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for s, n in enumerate(lengths_of(rows, shards, lengths)):
        path = folder / f"shard-{s:04d}.{fmt}"
        paths.append(path)
        ids = range(first, first + n)
        first += n
        if path.exists():
            continue
        tmp = path.with_suffix(".tmp")
        if fmt == "jsonl":
            rows = ({"x": x[i].tolist(), "y": int(y[i]), "id": i} for i in ids)
            tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        else:
            with tarfile.open(tmp, "w") as t:
                for i in ids:
                    for ext, data in (("x.json", json.dumps(x[i].tolist())), ("cls", str(int(y[i])))):
                        raw = data.encode()
                        info = tarfile.TarInfo(f"{i:08d}.{ext}")
                        info.size = len(raw)
                        t.addfile(info, io.BytesIO(raw))
        os.replace(tmp, path)
    return paths


def from_json(row: dict) -> tuple:
    return torch.tensor(row["x"]), row["y"], row["id"]


def typed(row: dict) -> dict:
    """A JSON line as a typed item: the label and index 0-dim int64 tensors, a 0-dim bfloat16 and float16,
    an int8 and a bool, a bool mask, a numpy float32 scalar and a string."""
    i, x = row["id"], torch.tensor(row["x"])
    return {"x": x, "y": torch.tensor(row["y"]), "index": torch.tensor(i), "mask": x > -1.5,
            "w": torch.tensor(1 + (i % 3) / 4, dtype=torch.bfloat16),
            "h": torch.tensor(i % 5 / 8, dtype=torch.float16),
            "code": torch.tensor(i % 7 - 3, dtype=torch.int8), "even": torch.tensor(i % 2 == 0),
            "scale": np.float32(1 + (i % 4) / 8), "name": f"item-{i}"}


def spoiled(bad: str, row: dict) -> dict:
    """A typed item that torch's default collate cannot batch with the others when its index is N mod 64."""
    item, (kind, n) = typed(row), bad.split(":")
    if row["id"] % 64 == int(n):
        if kind == "none":
            item["y"] = None
        elif kind == "nokey":
            del item["mask"]
        else:
            item["x"] = torch.zeros(9)
    return item


def from_tar(sample: dict) -> tuple:
    return torch.tensor(json.loads(sample["x.json"])), int(sample["cls"]), int(sample["__key__"])


class Faulty:
    """A stream that misbehaves as `fault` says."""

    def __init__(self, inner, fault: str, folder: Path, rank: int):
        self.inner, self.fault, self.folder, self.rank = inner, fault, folder, rank

    def shards(self):
        shards = self.inner.shards()
        return shards[::-1] if self.fault == "unsorted" and self.rank else shards  # each rank its own order

    def open(self, shard, start):
        kind, _, n = self.fault.partition(":")
        if kind == "ignore_start":
            return self.inner.open(shard, 0)
        if str(shard).endswith(f"shard-{int(n):04d}.jsonl"):
            if kind == "broken":
                raise OSError(f"cannot reach {shard}")
            marker = self.folder / f"opened-{os.getpid()}"
            tries = int(marker.read_text()) if marker.exists() else 0
            marker.write_text(str(tries + 1))
            if tries < 2:
                raise OSError(f"connection reset reading {shard}")
        return self.inner.open(shard, start)


class Lines:
    """JSON lines in memory, each decoded as it is read."""

    def __init__(self, lines: list[str], item=from_json):
        self.lines, self.item = lines, item

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> tuple:
        return self.item(json.loads(self.lines[i]))


class StreamLedger(Ledger):
    def __init__(self, rows: int = 1024, shards: int = 8, lengths: str = "equal", fmt: str = "jsonl",
                 fault: str = "", val: str = "stream", step_s: float = 0.0, record: bool = True,
                 hidden: int = 32, depth: int = 0, map_style: bool = False, bad: str = ""):
        super().__init__(rows=rows, step_s=step_s, record=record, hidden=hidden, depth=depth)
        self.shards, self.lengths, self.fmt, self.fault, self.val = shards, lengths, fmt, fault, val
        self.map_style, self.bad = map_style, bad
        """`bad` (typed items): "KIND:N" spoils the items whose index is N modulo 64 (item N of every shard
        of 64): "none" (the label None), "nokey" (no mask), "shape" (x of 9 floats) (`spoiled`)."""
        """The same JSON lines as a map-style dataset that decodes an item when it is read (bench/stream.py's
        control: the same work per item, without the stream)."""

    items = "tuple"

    def _tensor_shards(self, ctx, folder: Path, item) -> list[Path]:
        """One tensor shard per JSON Lines file (the same items, the same shards), written once by rank 0."""
        out = folder / f"tensors-{self.items}"
        if ctx.is_main and not out.exists():
            tmp = folder / f"tensors-{self.items}.tmp-{os.getpid()}"
            for k, p in enumerate(sorted(folder.glob("shard-*.jsonl"))):
                rows = (item(json.loads(line)) for line in p.read_text().splitlines() if line)
                streams.write_tensor_shards(rows, tmp, items_per_shard=10**9, prefix=f"shard-{k:04d}")
            os.replace(tmp, out)
        ctx.barrier()
        return sorted(out.glob("*.safetensors"))

    def datasets(self, ctx):
        super().datasets(ctx)  # the attempt's name
        folder = Path(ctx.run_dir) / "shards"
        if ctx.is_main:
            fmt = "jsonl" if self.fmt == "hf" else self.fmt
            write_shards(folder, ctx.seed, self.rows, self.shards, self.lengths,
                         "jsonl" if fmt == "tensors" else fmt)
            write_shards(folder / "val", ctx.seed + 1, 64, 2, "equal", "jsonl")
        ctx.barrier()
        paths = sorted(folder.glob(f"shard-*.{'jsonl' if self.fmt == 'tensors' else self.fmt}"))
        item = typed if self.items == "typed" else from_json
        if self.bad:
            item = functools.partial(spoiled, self.bad)
        if self.fmt == "tensors":  # the same items, written once as tensor shards beside the JSON lines
            paths = self._tensor_shards(ctx, folder, item)
            train = streams.tensor_shards(paths)
        elif self.fmt == "hf":  # the JSON Lines files through Hugging Face datasets' streaming loader
            import datasets

            paths = sorted(folder.glob("shard-*.jsonl"))
            files = [str(p) for p in paths]
            rows = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
            train = streams.HuggingFace(rows, item)
        else:
            train = streams.jsonl(paths, item) if self.fmt == "jsonl" else streams.tar(paths, from_tar)
        if self.fault:
            train = Faulty(train, self.fault, folder, ctx.rank)
        if self.map_style:
            train = Lines([line for p in paths for line in Path(p).read_text().splitlines() if line], item)
        val = streams.jsonl(sorted((folder / "val").glob("*.jsonl")), item)
        if self.val == "map":
            val = [item for shard in val.shards() for item in val.open(shard, 0)]
        return train, val


def shard_ids(rows: int, shards: int, lengths: str) -> list[range]:
    """Each shard's ids, in shard order (as write_shards numbers them)."""
    out, first = [], 0
    for n in lengths_of(rows, shards, lengths):
        out.append(range(first, first + n))
        first += n
    return out


def trained(run_dir: str | Path) -> dict[int, list[int]]:
    """step -> the ids its micro-batches trained, from the last attempt that trained it (an attempt that
    was killed may have trained steps its successor redid)."""
    from usertasks_ledger import read

    by_step: dict[int, dict[str, list[int]]] = {}
    for line in read(run_dir):
        by_step.setdefault(line["step"], {}).setdefault(line["attempt"], []).extend(line["indices"])
    return {step: attempts[max(attempts, key=lambda a: int(a.split("-")[0]))]
            for step, attempts in sorted(by_step.items())}


def left_unread(state: dict, rows: int, shards: int, lengths: str, before_epoch: int) -> list[int]:
    """The ids of the pieces a snapshot's stream state has not read yet, of epochs before `before_epoch`."""
    ids = shard_ids(rows, shards, lengths)
    out: list[int] = []
    for lane, (index, item, _) in zip(state["lanes"], state["pos"]):
        for k, (epoch, shard, start, _) in enumerate(lane[index:]):
            if epoch < before_epoch:
                out.extend(ids[shard][item if k == 0 else start:])
    return out


def epochs_once(run_dir: str | Path, rows: int, per_epoch: int) -> dict:
    """The ledger of a run of equal shards whose epochs are `per_epoch` whole steps: the steps trained, the
    sizes of their global batches, and the epochs whose steps did not train every id exactly once."""
    steps = trained(run_dir)
    bad = [e for e in range(len(steps) // per_epoch)
           if sorted(i for step in range(e * per_epoch + 1, (e + 1) * per_epoch + 1) for i in steps[step])
           != list(range(rows))]
    return {"steps": sorted(steps), "sizes": {len(ids) for ids in steps.values()}, "bad_epochs": bad}


class TypedLedger(StreamLedger):
    """StreamLedger whose items are typed dicts (`typed`); its loss reads every field, so a field read wrongly
    changes the model."""

    items = "typed"

    def loss(self, model, batch):
        return super().loss(model, self._plain(batch))

    def evaluate(self, model, batch):
        return super().evaluate(model, self._plain(batch))

    @staticmethod
    def _plain(batch: dict) -> tuple:
        assert batch["name"][0].startswith("item-") and batch["scale"].dtype == torch.float32
        weight = batch["w"].float() * batch["scale"] + batch["h"].float() + batch["code"].float() / 16
        x = batch["x"] * batch["mask"] * weight[:, None] + batch["even"].float()[:, None] / 8
        return x, batch["y"], batch["index"]
