"""The compile cache carried with the run (`parallel.compile=true`): the files inductor wrote to its
local cache for this run, packed by rank 0 into `run.dir/compile/` and unpacked by every rank of a later
attempt before it compiles, so that a restart or a resubmission on a node whose local cache is empty (a
fresh pod or node) does not pay for the compile again.

The local cache is whatever directory inductor uses: TORCHINDUCTOR_CACHE_DIR when set, torch's default
(under the temp directory) otherwise; the carried files are unpacked there, and what is already there is
left alone. What is carried is the whole of what a compile leaves there: the FX-graph and AOTAutograd
cache entries and the compiled kernels (C++ shared objects on CPU, Triton's under `triton/` unless
TRITON_CACHE_DIR moves them). torch's Mega-Cache (`torch.compiler.save_cache_artifacts`) carries the
cache entries but not the compiled kernels, and a restart with it alone still compiles every kernel
(docs/compile.md has the figures).

Which files are the run's: those the last attempt carried, and those written since this attempt
started. One file per device kind and torch version, behind a header with its digest: a missing, corrupt
or foreign file is one warning line and a cold compile, never a failure. The units' graphs do not
depend on the world size (every rank compiles the same units on micro-batches of `train.batch_size`),
so the file serves a run resumed at another world size too. Rank 0 packs it again whenever dynamo
compiled more graphs since the last time (the first step, the first evaluation, a recompile), and
replaces it atomically."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainapp.core import torch_private
from trainapp.errors import first_line
from trainapp.snapshots.files import fsync_dir, write_bytes

log = logging.getLogger(__name__)

MAGIC = b"trainapp compile cache 1\n"
SKIP = ("locks",)
"""Top-level entries of the local cache never carried (inductor's lock files)."""


def device_kind(device: torch.device) -> str:
    """`cpu`, or `cuda-sm90`: compiled kernels are made for one kind of device."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda-sm{major}{minor}"


class CompileCache:
    """The carried cache of the run in `run_dir` on `device`; `is_main`: this rank writes it."""

    def __init__(self, run_dir: str | Path, device: torch.device, is_main: bool) -> None:
        self.kind = device_kind(device)
        self.path = Path(run_dir) / "compile" / f"{self.kind}-torch{torch.__version__}.bin"
        self.local = Path(torch_private.inductor_cache_dir())
        self.is_main = is_main
        self.started = time.time() - 2  # file times may lag the clock a little (coarse timestamps)
        self.carried: set[str] = set()
        self._graphs_packed = 0
        self._failed = False

    def load(self) -> dict[str, Any]:
        """Before anything is compiled: the carried files into the local cache. What the start record says
        of it: how many files were carried and how many were new here, or `why` none were loaded."""
        if not self.path.exists():
            return {"file": str(self.path), "files": 0, "why": "none carried yet"}
        t0 = time.monotonic()
        try:
            header, payload = _unpack(self.path.read_bytes())
            names, new = self._place(payload)
        except Exception as e:  # anything: the cache only saves time, it may never stop the run
            if self.is_main:
                log.warning("parallel.compile: the carried compile cache %s was not loaded (%s): compiling "
                            "from scratch", self.path, first_line(e))
            return {"file": str(self.path), "files": 0, "why": first_line(e)}
        self.carried = set(names)
        took = time.monotonic() - t0
        if self.is_main:
            log.info("parallel.compile: loaded the carried compile cache %s into %s (%d files, %d new here, "
                     "%.1f s)", self.path, self.local, len(names), new, took)
        return {"file": str(self.path), "files": len(names), "new_here": new, "bytes": len(payload),
                "local": str(self.local), "took_s": round(took, 3)}

    def _place(self, payload: bytes) -> tuple[list[str], int]:
        """Every regular file of the carried tar into the local cache, each renamed into place whole; one
        that is there already is kept. (names carried, how many were new here)."""
        names, new = [], 0
        with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
            for member in tar.getmembers():
                rel = Path(member.name)
                if not member.isfile() or rel.is_absolute() or ".." in rel.parts:
                    raise ValueError(f"it holds {member.name!r}, which is no file of a cache")
                names.append(member.name)
                target = self.local / rel
                if target.exists():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(member)
                assert data is not None  # a regular file
                fd, stage = tempfile.mkstemp(dir=target.parent, prefix=".carried-")
                with os.fdopen(fd, "wb") as out:
                    out.write(data.read())
                os.chmod(stage, member.mode & 0o755)
                os.replace(stage, target)
                new += 1
        return names, new

    def save_if_grown(self) -> None:
        """Rank 0: the run's files of the local cache packed, when dynamo compiled more graphs since the
        last time (one dictionary read otherwise)."""
        if not self.is_main or self._failed:
            return
        graphs = torch_private.compiled_graphs()
        if graphs <= self._graphs_packed:
            return
        self._graphs_packed = graphs
        try:
            self._write(self._pack(), graphs)
        except Exception as e:  # a full disk, a cache torch laid out otherwise: warm restarts are lost
            self._failed = True
            log.warning("parallel.compile: the compile cache could not be written to %s (%s): a restart "
                        "will compile again", self.path, first_line(e))

    def _pack(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(self.local.rglob("*")):
                rel = path.relative_to(self.local).as_posix()
                if (not path.is_file() or path.is_symlink() or rel.split("/")[0] in SKIP
                        or path.name.startswith((".carried-", "tmp"))):
                    continue
                if rel in self.carried or path.stat().st_mtime >= self.started:
                    tar.add(path, arcname=rel, recursive=False)
        return buf.getvalue()

    def _write(self, payload: bytes, graphs: int) -> None:
        header = {"torch": torch.__version__, "device": self.kind, "graphs": graphs, "bytes": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stage = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        write_bytes(stage, lambda f: f.writelines([MAGIC, json.dumps(header).encode() + b"\n", payload]))
        os.replace(stage, self.path)
        fsync_dir(self.path.parent)


def _unpack(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a carried file; ValueError saying what is wrong with it."""
    if not blob.startswith(MAGIC):
        raise ValueError("not a trainapp compile cache")
    line, _, payload = blob[len(MAGIC):].partition(b"\n")
    header = json.loads(line)
    if header.get("torch") != torch.__version__:
        raise ValueError(f"written by torch {header.get('torch')}, this is {torch.__version__}")
    if len(payload) != header.get("bytes") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its digest does not match: the file is damaged or incomplete")
    return header, payload
