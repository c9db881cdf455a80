"""Experiment trackers beside TensorBoard (`logging.trackers`): W&B and MLflow as MetricsLogger sinks.

Each sink gets every step's metrics under the names TensorBoard has (rollout/rewards_mean, train/loss, ...;
numbers only, non-finite values left out as TensorBoard leaves them), the evaluations under eval/*, and the
resolved config as parameters with flattened dotted keys (`algo.clip_eps_low`). MLflow refuses some characters in
names: those become `_` there (`mlflow_key`); rlsys's own names have none.

- `wandb` runs offline by default (`logging.wandb_mode`): the run files under `<run_dir>/wandb/` are what
  `wandb sync <run_dir>/wandb/offline-run-*` uploads; nothing reaches the network during training.
- `mlflow` writes to `logging.mlflow_tracking_uri`, by default a SQLite store `<run_dir>/mlflow.db` that
  `mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db` reads (MLflow 3 refuses its old `./mlruns` file
  store unless MLFLOW_ALLOW_FILE_STORE=true).

The trackers' run ids are kept in `<run_dir>/trackers.json`: a resumed run (start step > 0) logs into the same
W&B run id and the same MLflow run. The steps it redoes after its last checkpoint are logged again: MLflow
keeps both values in the metric's history; W&B's server keeps the first value of a step it has already seen.

wandb and mlflow are imported only when a tracker is opened; `import rlsys` imports neither.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRACKER_PACKAGES = {"wandb": ("wandb", "pip install wandb"),
                    "mlflow": ("mlflow", "pip install mlflow (or mlflow-skinny sqlalchemy alembic)")}
"""tracker name -> (module it needs, how to install it): `rlsys.config.LoggingConfig` checks them at load."""

IDS_FILE = "trackers.json"


def flat_params(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`{"algo": {"clip_eps_low": 0.2}}` -> `("algo.clip_eps_low", 0.2)`; lists stay values."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_params(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of ``metrics``: what TensorBoard gets (strings such as an eval's tag are left out)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


MLFLOW_MAX_PARAM_CHARS = 6000  # MLflow refuses longer param values (e.g. a long system prompt): cut


def mlflow_key(name: str) -> str:
    """``name`` as MLflow takes it: characters other than letters, digits, `_-. :/` become `_`, as do empty, `.`
    and `..` path parts (MLflow refuses names that a path would normalise). TensorBoard's names pass unchanged;
    an `error/<outcome>` whose outcome label has other characters does not stop the job."""
    parts = re.sub(r"[^/\w.\- :]", "_", name).split("/")
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)


def _failed() -> bool:
    """Whether close() runs while an exception propagates (MetricsLogger.close in the driver's `finally`)."""
    return sys.exc_info()[0] is not None


class WandbSink:
    """One W&B run; `run.log(metrics, step=step)` with the job's step, so W&B's step axis is the job's."""

    def __init__(self, run_dir: Path, params: dict[str, Any], project: str, mode: str, name: str,
                 run_id: str | None = None) -> None:
        import wandb

        self.run = wandb.init(
            project=project, name=name, dir=str(run_dir), mode=mode, config=params,
            id=run_id, resume="allow" if run_id else None,
            # the driver's console stays the driver's: no stdout wrapping; no `wandb login` prompt offline
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id: str = self.run.id

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def log_eval(self, step: int, tag: str, metrics: dict[str, Any]) -> None:
        self.log(step, metrics)

    def close(self) -> None:
        import wandb

        self.run.finish(exit_code=1 if _failed() else 0)
        # finish() can return before wandb-core has written the run file out (seen with 0.31 offline: a file of
        # its header only, read right after); teardown waits for it and stops the service process
        wandb.teardown()


class MlflowSink:
    """One MLflow run through `MlflowClient` (no fluent API: no process-global active run)."""

    def __init__(self, tracking_uri: str, params: dict[str, Any], experiment: str, name: str,
                 run_id: str | None = None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.tracking_uri = tracking_uri
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            # params are immutable in MLflow: a resumed run adds only the ones its first part did not log
            logged = self.client.get_run(run_id).data.params
        else:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            logged = {}
        self.run_id = run_id
        new = [Param(k, (json.dumps(v) if isinstance(v, (list, dict)) else str(v))[:MLFLOW_MAX_PARAM_CHARS])
               for k, v in params.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=new[i:i + 100])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step)
                                                    for k, v in scalars(metrics).items()])

    def log_eval(self, step: int, tag: str, metrics: dict[str, Any]) -> None:
        self.log(step, metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if _failed() else "FINISHED")


def open_trackers(cfg: Any, run_dir: str | Path, start_step: int = 0) -> list[WandbSink | MlflowSink]:
    """The sinks `cfg.logging.trackers` names, opened for this run (``cfg``: an rlsys.config.Config). A resumed
    run (``start_step`` > 0) continues the runs whose ids `<run_dir>/trackers.json` holds; a fresh one starts
    new runs and records their ids there."""
    log = cfg.logging
    if not log.trackers:
        return []
    run_dir = Path(run_dir)
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if start_step > 0 and ids_path.is_file() else {}
    params = dict(flat_params(cfg.model_dump(mode="json", exclude_none=True)))
    name = log.run_name or run_dir.resolve().name
    sinks: list[WandbSink | MlflowSink] = []
    try:
        for tracker in log.trackers:
            if tracker == "wandb":
                sinks.append(WandbSink(run_dir, params, log.wandb_project, log.wandb_mode, name, ids.get("wandb")))
            else:
                uri = log.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
                # a different store than the first part's: its run id means nothing there
                run_id = ids.get("mlflow") if ids.get("mlflow_tracking_uri") == uri else None
                sinks.append(MlflowSink(uri, params, log.mlflow_experiment, name, run_id))
                ids["mlflow_tracking_uri"] = uri
            ids[tracker] = sinks[-1].run_id
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return sinks
