"""Experiment tracking (trainapp/observe/tracking/): one MLflow run and one W&B run per run directory across
restarts, one value per step (the one the final model descends from), and a tracker that is away never
holds training. Against a real MLflow tracking server (SQLite backend, on 127.0.0.1, started and stopped
here) behind a TCP door the test opens and closes, and W&B in offline mode."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import PY, QUICK, exited, metrics, one_error_line, torchrun2, trainapp, wait_for_record, \
    wait_until

from trainapp.observe.metrics import METRICS
from trainapp.observe.tracking.lineage import Reader
from helpers import free_port

MLFLOW = str(Path(PY).parent / "mlflow")


def _write(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / METRICS, "a") as f:
        for r in records:
            f.write(json.dumps({"time": 1.0, **r}) + "\n")


def _train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "lr": 0.1, "world_size": 2}


def expected(run_dir: Path, key: str = "loss") -> dict[int, tuple[float, int]]:
    """metrics.jsonl's final lineage of `key`, worked out the plain way: each start drops every value of a
    step after the one it resumed from. step -> (value, the record's time in ms: which attempt's)."""
    out: dict[int, tuple[float, int]] = {}
    for r in metrics(run_dir):
        if r["kind"] == "start":
            out = {s: v for s, v in out.items() if s <= (r.get("resumed_step") or 0)}
        elif r["kind"] in ("train", "eval") and key in r:
            out[r["step"]] = (r[key], int(r["time"] * 1000))
    return out


def test_the_reader_keeps_one_value_per_step_from_the_attempt_the_final_model_descends_from(tmp_path):
    run_dir = tmp_path / "run"
    # Attempt 1 logs steps 2..16 and dies; attempt 2 resumed from 10 logs 12..20 and dies; attempt 3
    # resumed from 20 runs on (the reader is made while it runs).
    _write(run_dir, [{"kind": "start", "step": 0}, *[_train(s, 1.0 + s) for s in range(2, 17, 2)],
                     {"kind": "start", "step": 10, "resumed_step": 10},
                     *[_train(s, 2.0 + s) for s in range(12, 21, 2)],
                     {"kind": "start", "step": 20, "resumed_step": 20}, _train(22, 3.22), _train(24, 3.24)])
    reader = Reader(run_dir)
    reader.read()
    # Every earlier attempt's kept value is final; the running attempt's wait for its snapshots, and the
    # row of the newest final step waits for the next (an `end` record can still add to it).
    got = {s: r["loss"][0] for s, r in reader.ready()}
    assert got == {**{s: 1.0 + s for s in (2, 4, 6, 8, 10)}, **{s: 2.0 + s for s in (12, 14, 16, 18)}}, got
    reader.sent_through(18)
    reader.release(24)  # a snapshot of step 24 was published
    assert [s for s, _ in reader.ready()] == [20, 22]
    assert reader.ready()[0][1]["loss"][0] == 22.0
    reader.sent_through(22)
    _write(run_dir, [{"kind": "eval", "step": 24, "val_loss": 0.5, "val_count": 8},
                     {"kind": "end", "steps": 24, "goodput": 0.75, "badput_s": {"restart": 1.5}}])
    reader.read()
    assert reader.ended and [s for s, _ in reader.ready()] == [24]
    assert set(reader.ready()[0][1]) == {"loss", "lr", "world_size", "val_loss", "goodput",
                                         "badput_s/restart"}
    # A reader that starts over with the tracker's mark skips what it holds; the limit bounds memory.
    again = Reader(run_dir, sent=14, limit=2)
    again.read()
    assert sorted(again.pending) == [16, 18]
    again.sent_through(18)
    again.read()
    assert sorted(again.pending) == [20, 22]


def test_a_bad_tracker_setting_stops_before_training_with_one_line(tmp_path):
    r = trainapp("train", f"run.dir={tmp_path / 'a'}", "observe.mlflow_uri=ftp://tracker:21")
    line = one_error_line(r, "train", "observe.mlflow_uri='ftp://tracker:21': unknown scheme 'ftp'")
    assert "http(s)://HOST:PORT" in line
    # W&B set without its package (hidden from this process as Python hides a module: None in sys.modules).
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = trainapp("train", f"run.dir={tmp_path / 'b'}", "observe.wandb_project=demo", "train.max_steps=2",
                 env=env, fresh=True)  # a fresh interpreter: sitecustomize runs at its start
    one_error_line(r, "train", "observe.wandb_project='demo' needs the wandb package: pip install "
                               "'trainapp[wandb]'")
    assert not (tmp_path / "b" / "metrics.jsonl").exists() or not metrics(tmp_path / "b", "train")


@pytest.mark.slow
def test_trainapp_track_sends_a_runs_final_values_once_and_a_changed_resume_as_params_of_its_own(tmp_path):
    """`trainapp track` on a run that ended (two attempts; the second resumed from step 8 with another
    learning rate) into a real MLflow store (SQLite): each step once, the resumed attempt's value for the
    step both logged, the first config as params and the change as a param of its own; a second
    `trainapp track` sends nothing."""
    from mlflow.tracking import MlflowClient

    from trainapp.config import Config

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Config().to_dict()
    first["observe"]["mlflow_uri"] = uri
    second = json.loads(json.dumps(first))
    second["optim"]["lr"] = 0.5
    run_dir = tmp_path / "run"
    _write(run_dir, [{"kind": "start", "step": 0, "config": first, "world_size": 2, "launcher": "torchrun"},
                     *[_train(s, 1.0 + s) for s in range(2, 11, 2)], {"kind": "snapshot", "step": 8},
                     {"kind": "start", "step": 8, "resumed_step": 8, "config": second, "world_size": 1,
                      "launcher": "torchrun", "config_changes": {"optim.lr": [0.05, 0.5]}},
                     *[_train(s, 2.0 + s) for s in range(10, 15, 2)],
                     {"kind": "eval", "step": 14, "val_loss": 0.25, "val_count": 4},
                     {"kind": "end", "steps": 14, "goodput": 0.5, "badput_s": {"restart": 2.0}}])
    r = trainapp("track", str(run_dir), "--wait-s", "60")
    assert r.returncode == 0 and ": 24 values sent; its run closed" in r.output, r.output[-3000:]
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"])
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert loss == [(2, 3.0), (4, 5.0), (6, 7.0), (8, 9.0), (10, 12.0), (12, 14.0), (14, 16.0)], loss
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["optim.lr/resumed_at_8"] == "0.5"
    assert run.data.tags["trainapp.world_size"] == "1" and run.data.tags["trainapp.attempts"] == "2"
    assert run.data.tags["trainapp.config_changes"] == "optim.lr 0.05 -> 0.5"
    assert run.data.metrics["goodput"] == 0.5 and run.data.metrics["badput_s/restart"] == 2.0
    assert run.info.status == "FINISHED"
    # Its files beside the store, not in the directory trainapp was started from (the repository here).
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri()), run.info.artifact_uri
    r = trainapp("track", str(run_dir), "--wait-s", "60")
    assert r.returncode == 0 and ": 0 values sent" in r.output, r.output[-3000:]
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 7


class Door:
    """A TCP door in front of the MLflow server: shut, nothing listens on its port (connection refused, as
    a server that is down or gone); open, each connection is passed through to the server."""

    def __init__(self, target: int) -> None:
        self.port, self.target = free_port(), target
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def open(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def shut(self) -> None:
        if self._listener is not None:
            # A close alone leaves an accept() blocked in another thread accepting (Linux); shutdown wakes it.
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._conns = []


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` with a SQLite backend and its own artifact store, on 127.0.0.1; stopped by its PID."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([MLFLOW, "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
                             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            # No job runner: it keeps a huey store in a /dev/shm folder of its own that the
                            # server leaves behind, and nothing here runs MLflow jobs.
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        import urllib.request

        try:
            return urllib.request.urlopen(f"{url}/health", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_until(up, "the MLflow server answering", timeout=180,
                   gone=exited(proc, lambda: (root / "server.log").read_text()))
        yield port, url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _client(url: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=url)


def _history(client, run_id: str, key: str) -> list[tuple[int, tuple[float, int]]]:
    return sorted((m.step, (m.value, m.timestamp)) for m in client.get_metric_history(run_id, key))


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict]]:
    """(run ids, history rows in order) of every offline W&B run file under RUN_DIR/wandb: the `.wandb`
    files are a LevelDB-style log of protobuf records (32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids, rows = set(), []
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, buf = f.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                if record.WhichOneof("record_type") == "run":
                    ids.add(record.run.run_id)
                elif record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in record.history.item})
    return ids, rows


def _sent_through(url: str, run_dir: Path) -> int:
    """How far the MLflow run of RUN_DIR goes (its `trainapp.sent_through` tag), asked over MLflow's REST
    API (the client's import alone takes seconds on a busy machine); -1 before there is one."""
    try:
        run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow"]["run_id"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return -1
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=5) as r:
        tags = {t["key"]: t["value"] for t in json.load(r)["run"]["data"].get("tags", [])}
    return int(tags.get("trainapp.sent_through", -1))


@pytest.mark.slow
def test_a_killed_rank_and_a_tracker_away_at_start_and_mid_run_leave_one_run_with_each_step_once(
        mlflow_server, tmp_path, request):
    """2 ranks under torchrun log to MLflow (through the door, shut at the start) and to W&B offline. Once
    the tracker was found away, the door opens; when MLflow holds some steps it shuts again (the server
    gone mid-run) until that is noticed; then rank 1 is SIGKILLed just after a logged step that the
    newest snapshot does not cover, torchrun restarts both from that snapshot, and the door opens. In the
    end both trackers hold one run whose `loss` has every logged step once, with metrics.jsonl's final
    values (the restart's for the step it trained again), the config as params, the report and the
    exported model; `trainapp track` afterwards sends nothing more."""
    port, url = mlflow_server
    door = Door(port)
    request.addfinalizer(door.shut)
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = torchrun2(run_dir, *QUICK, "train.log_every=2", "train.max_steps=60", "train.epochs=20",
                    "snapshot.every_steps=4", "snapshot.memory_every_steps=0",  # the storage tier's resume
                    # Steps of 300 ms (a sleep: the numbers do not change): the door's moves fall between
                    # snapshots, while training goes on.
                    "drill.slow_rank=0", "drill.slow_ms=300",
                    f"observe.mlflow_uri=http://127.0.0.1:{door.port}", "observe.mlflow_experiment=tests",
                    "observe.wandb_project=trainapp-tests")
    out = tmp_path / "out.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    gone = exited(proc, out.read_text)

    def said(what: str, times: int) -> Callable[[], bool]:
        return lambda: out.read_text().count(what) >= times

    try:
        wait_until(said("does not answer", 1), "the tracker found away at the start", gone=gone, timeout=240)
        door.open()
        wait_until(lambda: _sent_through(url, run_dir) >= 2, "MLflow holding a step", gone=gone, timeout=120)
        door.shut()  # gone mid-run
        wait_until(said("does not answer", 2), "the tracker found gone", gone=gone, timeout=120)
        # Just after a logged step the newest snapshot does not cover (snapshots every 4 steps).
        now = max(r["step"] for r in metrics(run_dir, "train"))
        killed = wait_for_record(run_dir, "train", lambda r: r["step"] > now and r["step"] % 4 == 2,
                                 gone=gone)["step"]
        os.kill(metrics(run_dir, "start")[0]["placement"][1]["pid"], signal.SIGKILL)
        wait_until(lambda: len(metrics(run_dir, "start", missing_ok=True)) == 2, "the restart", gone=gone,
                   timeout=240)
        door.open()
        assert proc.wait(300) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    starts = metrics(run_dir, "start")
    assert len(starts) == 2 and starts[1]["resumed_step"] in (killed - 2, killed + 2), (killed, starts)
    redone = killed if starts[1]["resumed_step"] < killed else None
    # One warning line each time the tracker stopped answering (at the start, mid-run), none per retry;
    # one when it answered again. Training went on all along.
    first = text[:text.index("trainapp.core.loop: config", text.index("trainapp.core.loop: config") + 1)]
    assert first.count("does not answer") == 2 and first.count("answers again") == 1, first[-4000:]
    assert "Traceback" not in "\n".join(line for line in text.splitlines() if "tracking" in line)

    client = _client(url)
    want = expected(run_dir)
    assert sorted(want) == list(range(2, 61, 2)), want
    if redone is not None:  # the step logged twice: the restart's value (its record's time) is the one kept
        assert [r["step"] for r in metrics(run_dir, "train")].count(redone) == 2

    ident = json.loads((run_dir / "tracking.json").read_text())
    run = client.get_run(ident["mlflow"]["run_id"])
    assert len(client.search_runs([run.info.experiment_id])) == 1  # one MLflow run for the whole run
    assert _history(client, run.info.run_id, "loss") == sorted(want.items())
    assert _history(client, run.info.run_id, "val_loss") == sorted(expected(run_dir, "val_loss").items())
    assert [s for s, _ in _history(client, run.info.run_id, "val_loss")] == [60]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "60"
    assert run.data.params["observe.mlflow_experiment"] == "tests"
    assert run.data.tags["trainapp.launcher"] == "torchrun" and run.data.tags["trainapp.attempts"] == "2"
    assert 0 < run.data.metrics["goodput"] <= 1
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.txt", "report.png", "model"} <= arts, arts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} == {"model/model.safetensors",
                                                                                   "model/trainapp.json"}
    # W&B offline: one run id over both attempts, each logged step once with the same values.
    ids, rows = wandb_history(run_dir)
    assert ids == {ident["wandb"]["key"]}, ids
    losses = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert losses == [(s, v) for s, (v, _) in sorted(want.items())], losses
    # Sending again what the trackers hold sends nothing, and nothing is doubled.
    r = trainapp("track", str(run_dir), env=env)
    assert r.returncode == 0 and "mlflow at http" in r.output, r.output[-3000:]
    assert ": 0 values sent; its run closed" in r.output, r.output[-3000:]
    assert _history(client, run.info.run_id, "loss") == sorted(want.items())


@pytest.mark.slow
def test_a_process_killed_while_it_makes_a_sqlite_store_leaves_none_or_a_whole_one(tmp_path):
    """MLflow makes a store's tables in many steps, and a rank Ray Train stops because another failed can be
    among them: the store is made beside its path and linked whole (mlflow_sink.make_sqlite_store), so every
    store a later process finds opens. Without that, a kill mid-way leaves "table ... already exists"."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    code = ("import sys, mlflow.tracking; print('imported', flush=True); "
            "from trainapp.observe.tracking.mlflow_sink import make_sqlite_store; "
            "make_sqlite_store(sys.argv[1])")
    found = []
    for i, delay in enumerate((0.05, 0.2, 0.4, 0.7, 1.0, 1.5)):
        uri = f"sqlite:///{tmp_path}/s{i}/mlflow.db"
        p = subprocess.Popen([PY, "-c", code, uri], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        assert p.stdout.readline().strip() == "imported"
        threading.Event().wait(delay)
        p.kill()
        p.wait()
        p.stdout.close()
        found.append((tmp_path / f"s{i}" / "mlflow.db").exists())
        # Absent or whole: this process opens it (making it when absent) and writes to it.
        client = MlflowClient(tracking_uri=uri)
        assert client.create_experiment(f"e{i}")
    assert not all(found), "every kill came after the store was made: the test saw no kill during it"
