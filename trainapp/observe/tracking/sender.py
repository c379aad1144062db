"""The thread on rank 0 that hands a run's values to one tracker (MLflow or W&B), so a tracker that is slow,
away or broken never holds training: it reads metrics.jsonl (trainapp/observe/tracking/lineage.py
decides which values are final) and sends them, retrying with backoff; one warning line when the
tracker stops answering, one when it answers again.

What it keeps in the run directory (`tracking.json`): each tracker's run identity, made before the
tracker's run is, so every restart, requeue, Ray retry and resubmission of the run opens the same one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from trainapp.config.changes import line
from trainapp.observe.tracking.lineage import Reader, params

if TYPE_CHECKING:
    from trainapp.observe.tracking.lineage import Row

log = logging.getLogger("trainapp.observe.tracking")

IDENTITY = "tracking.json"
STOP_WAIT_S = 5.0
"""How long a stopped or failed attempt waits for its tracker: the next attempt sends the rest."""


class Sink(Protocol):
    """One tracker (trainapp/observe/tracking/mlflow_sink.py, wandb_sink.py)."""

    name: str
    where: str

    def open(self, ident: dict[str, Any]) -> tuple[dict[str, Any], int]: ...
    def describe(self, params: dict[str, str], tags: dict[str, str]) -> None: ...
    def send(self, rows: list[tuple[int, Row]]) -> int: ...
    def artifacts(self, files: list[Path], model: Path | None) -> None: ...
    def close(self, status: str) -> None: ...


def _kept(run_dir: Path) -> dict[str, Any]:
    """What tracking.json holds: tracker name -> that tracker's identity (empty when there is none)."""
    try:
        return dict(json.loads((run_dir / IDENTITY).read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def identity(run_dir: Path, name: str) -> dict[str, Any]:
    """This run directory's identity at tracker `name` (its key made and kept on first use)."""
    kept = _kept(run_dir)
    if name not in kept:
        kept[name] = {"key": uuid.uuid4().hex[:16]}
        keep(run_dir, kept)
    return dict(kept[name])


def keep(run_dir: Path, kept: dict[str, Any]) -> None:
    path = run_dir / IDENTITY
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(kept, indent=1) + "\n")
    os.replace(tmp, path)


def _update(run_dir: Path, name: str, ident: dict[str, Any]) -> None:
    kept = _kept(run_dir)
    if kept.get(name) != ident:
        kept[name] = ident
        keep(run_dir, kept)


class Sender:
    """Sends one run's final values to `sink` from a daemon thread. `fence` raises once the run's lease is
    taken over (this rank may write nothing more); `published` gives the step of the newest snapshot
    this attempt published, None for none yet."""

    POLL_S = 2.0
    BACKOFF_MAX_S = 10.0

    def __init__(self, sink: Sink, run_dir: Path, launcher: str,
                 fence: Callable[[str], None] | None = None) -> None:
        self.sink, self.run_dir, self.launcher, self.fence = sink, run_dir, launcher, fence
        self.published: Callable[[], int | None] = lambda: None
        self.reader: Reader | None = None
        self.ident: dict[str, Any] | None = None
        self.model: Path | None = None
        self.sent_values = 0
        self._described = 0  # `start` records already described to the tracker
        self._wake, self._stop = threading.Event(), threading.Event()
        self._status: str | None = None  # set when the attempt ends: what to close the tracker's run with
        self._closed = False
        self._away: str | None = None  # the warning said while the tracker does not answer
        self._thread = threading.Thread(target=self._run, name=f"tracking-{sink.name}", daemon=True)

    def start(self) -> None:
        """After this attempt's `start` record is written."""
        self._thread.start()

    @property
    def closed(self) -> bool:
        """The tracker took everything final and its run was closed."""
        return self._closed

    def nudge(self) -> None:
        self._wake.set()

    def finish(self, status: str, wait_s: float, model: str | None = None) -> None:
        """The attempt is over (`status`: FINISHED, KILLED or FAILED): send what is final, the artifacts
        at a FINISHED end, close the tracker's run; wait at most `wait_s`, then name what is unsent."""
        if self._status is not None or not self._thread.is_alive():
            return
        self.model = Path(model) if model else None
        self._status = status
        self._wake.set()
        self._thread.join(wait_s)
        if not self._closed:
            left = self.reader.unsent() if self.reader is not None else None
            what = f"steps {left[0]}-{left[1]}" if left else "its run's closing"
            log.warning("tracking: %s did not take %s within %.0f s; the values stay in metrics.jsonl: "
                        "`trainapp track %s` sends them when it answers", self.sink.where, what, wait_s,
                        self.run_dir)
        self._stop.set()

    def _run(self) -> None:
        if sys.platform == "linux":
            # Linux nices threads one by one: the sender yields the cores to training (it has a snapshot
            # interval to send in), as the background snapshot writer does.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self._round()
                if self._away is not None:
                    log.warning("tracking: %s answers again; sending what waited", self.sink.where)
                    self._away = None
                backoff = 1.0
                if self._closed:
                    return
                self._wake.wait(self.POLL_S)
            except _Fenced:
                return
            except Exception as e:  # a tracker's every failure: training goes on, the values wait in the file
                if self._away is None:
                    self._away = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    log.warning("tracking: %s does not answer (%s); the values wait in metrics.jsonl and "
                                "are sent when it answers", self.sink.where, self._away)
                self._wake.wait(backoff)
                backoff = min(backoff * 2, self.BACKOFF_MAX_S)
            self._wake.clear()

    def _check_fence(self) -> None:
        if self.fence is not None:
            try:
                self.fence("tracking")
            except Exception:
                raise _Fenced() from None

    def _round(self) -> None:
        if self.ident is None:
            self._check_fence()
            ident, sent = self.sink.open(identity(self.run_dir, self.sink.name))
            self.reader = Reader(self.run_dir, sent=max(sent, int(ident.get("sent_through", -1))))
            self.ident = ident
            _update(self.run_dir, self.sink.name, ident)
        reader = self.reader
        assert reader is not None  # made with the identity
        published = self.published()
        if published is not None:
            reader.release(published)
        while True:
            reader.read()
            self._describe(reader)
            ready = reader.ready()
            if not ready:
                break
            last = self.sink.send(ready)
            self.sent_values += sum(len(r) for _, r in ready)
            reader.sent_through(last)
            # Kept beside the identity for every tracker: the mark of one that keeps none a resumed run can
            # read (W&B offline); a tracker's own mark (MLflow's tag) wins where it is further.
            self.ident = {**self.ident, "sent_through": last}
            self._check_fence()
            _update(self.run_dir, self.sink.name, self.ident)
        if self._status is not None:
            if self._status == "FINISHED":
                self.sink.artifacts(self._artifacts(), self.model)
            self.sink.close(self._status)
            self._closed = True

    def _describe(self, reader: Reader) -> None:
        """Params and tags of the `start` records read since the last call: the first attempt's config as
        params, each resume's config changes as params of their own (`KEY/resumed_at_STEP`: a tracker's
        params cannot change), tags that say where the run is now."""
        if self._described == len(reader.starts):
            return
        new, first = reader.starts[self._described:], reader.starts[0]
        out = params(first.get("config") or {}) if self._described == 0 else {}
        for s in new:
            for key, (_, value) in (s.get("config_changes") or {}).items():
                out[f"{key}/resumed_at_{s.get('step')}"] = json.dumps(value, default=str)
        import torch  # here: the Ray driver checks the trackers' settings through this package, torch-free

        last = reader.starts[-1]
        tags = {"trainapp.task": str((last.get("config") or {}).get("task", {}).get("name", "")),
                "trainapp.launcher": str(last.get("launcher", self.launcher)),
                "trainapp.world_size": str(last.get("world_size")),
                "trainapp.attempts": str(len(reader.starts)),
                "trainapp.version": _version(), "torch.version": torch.__version__,
                "trainapp.run_dir": str(self.run_dir)}
        if last.get("config_changes"):
            tags["trainapp.config_changes"] = line(last["config_changes"])[:5000]
        self.sink.describe({_key(k): v for k, v in out.items()}, tags)
        self._described = len(reader.starts)

    def _artifacts(self) -> list[Path]:
        """The run's report (`trainapp report`, in a process of its own: plotting is a tool's job, and a
        failure there must not touch the run), what of it was written."""
        try:
            done = subprocess.run([sys.executable, "-m", "trainapp", "report", str(self.run_dir)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
            if done.returncode != 0:
                log.warning("tracking: no report for %s: %s", self.sink.where,
                            (done.stderr.strip().splitlines() or ["?"])[-1])
        except subprocess.TimeoutExpired:
            log.warning("tracking: `trainapp report %s` took over 120 s; no report artifact", self.run_dir)
        return [p for p in (self.run_dir / "report.txt", self.run_dir / "report.png") if p.exists()]


class _Fenced(Exception):
    """The run's lease was taken over: this attempt sends nothing more."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainapp")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def _key(key: str) -> str:
    """A param name MLflow takes (letters, digits, `_-. /:`)."""
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in key)[:250]
