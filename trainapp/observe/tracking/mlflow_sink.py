"""MLflow as a tracker (`observe.mlflow_uri`), through `MlflowClient`: no global active run, so a user's
own `mlflow` calls in their task are left alone.

One MLflow run per run directory: the run is found again by its `trainapp.run_key` tag (a key kept in
the run directory before the run is made, so an attempt killed between making it and noting its id does
not make a second), and how far its metrics go is the `trainapp.sent_through` tag, set in the same
`log_batch` call as the metrics it covers: a batch and its mark land together or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainapp.observe.tracking.lineage import chunks

if TYPE_CHECKING:
    from trainapp.observe.tracking.lineage import Row

KEY_TAG, SENT_TAG = "trainapp.run_key", "trainapp.sent_through"
MOST = 900
"""Values per `log_batch` call (MLflow takes 1000 metrics, params and tags together)."""


def make_sqlite_store(uri: str) -> None:
    """A new SQLite store (`sqlite:///PATH`) made whole in a file beside PATH, then linked into place.

    MLflow creates a store's tables in many steps; a process killed among them (a rank Ray Train stops
    because another one failed) leaves a store no later process can open ("table ... already exists").
    Made aside, a store is either whole at PATH or not there at all; a process that loses the race to
    link it keeps the one that won."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if not path.name or path.exists():
        return
    from mlflow.tracking import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    MlflowClient(tracking_uri=f"sqlite:///{tmp.resolve()}").search_experiments(max_results=1)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


class MlflowSink:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        self.where = f"mlflow at {uri}"
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.run_id: str | None = None
        self._client: Any = None

    def _mlflow(self) -> Any:
        if self._client is None:
            # The client's own retries (7, backing off to minutes) would hold the sender; it retries itself.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow.tracking import MlflowClient

            make_sqlite_store(self.uri)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def open(self, ident: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The run `ident` names (its key, and its id once known), made when there is none; (what to keep
        in the run directory, the last step it holds)."""
        client = self._mlflow()
        run = None
        if ident.get("run_id") and ident.get("uri") == self.uri:
            run = client.get_run(ident["run_id"])
        if run is None:
            exp = client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else _create_experiment(client, self.experiment,
                                                                      artifact_root(self.uri))
            found = client.search_runs([exp_id], filter_string=f"tags.`{KEY_TAG}` = '{ident['key']}'",
                                       max_results=1)
            run = found[0] if found else client.create_run(exp_id, run_name=self.run_name,
                                                           tags={KEY_TAG: ident["key"]})
        self.run_id = run.info.run_id
        if run.info.status != "RUNNING":
            client.update_run(self.run_id, status="RUNNING")
        sent = int(run.data.tags.get(SENT_TAG, -1))
        return {**ident, "uri": self.uri, "experiment": self.experiment, "run_id": self.run_id}, sent

    def describe(self, params: dict[str, str], tags: dict[str, str]) -> None:
        """Params (never changed once logged: MLflow refuses) and tags (overwritten)."""
        from mlflow.entities import Param, RunTag

        items = sorted(params.items())
        for i in range(0, max(len(items), 1), 100):
            batch_tags = [RunTag(k, v) for k, v in tags.items()] if i == 0 else []
            self._mlflow().log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + 100]],
                                     tags=batch_tags)

    def send(self, rows: list[tuple[int, Row]]) -> int:
        """Every row, in batches that each carry their own `sent_through` mark; the last step sent."""
        from mlflow.entities import Metric, RunTag

        last = -1
        for chunk in chunks(rows, MOST):
            metrics = [Metric(k, v, ms, step) for step, row in chunk for k, (v, ms) in row.items()]
            last = chunk[-1][0]
            self._mlflow().log_batch(self.run_id, metrics=metrics, tags=[RunTag(SENT_TAG, str(last))])
        return last

    def artifacts(self, files: list[Path], model: Path | None) -> None:
        client = self._mlflow()
        for f in files:
            client.log_artifact(self.run_id, str(f))
        if model is not None:
            client.log_artifacts(self.run_id, str(model), "model")

    def close(self, status: str) -> None:
        """`status`: FINISHED, KILLED (a stop: the next attempt reopens it) or FAILED."""
        if self.run_id is not None:
            self._mlflow().set_terminated(self.run_id, status)


def artifact_root(uri: str) -> str | None:
    """Where a new experiment's artifacts go: beside a SQLite store's file (`mlartifacts/`), not MLflow's
    default `./mlruns` of whatever directory the run was started from; a server's own root otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()


def _create_experiment(client: Any, name: str, artifacts: str | None = None) -> str:
    try:
        return str(client.create_experiment(name, artifact_location=artifacts))
    except Exception:  # another run made it a moment ago
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)
