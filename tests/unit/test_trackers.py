"""The W&B and MLflow sinks (rlsys/trackers.py), read back with each library's own reader: MlflowClient for MLflow,
wandb's record protobuf for the offline `.wandb` file. wandb runs offline: nothing reaches the network."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from rlsys.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)

STEPS = [{"rollout/rewards_mean": 0.25, "train/loss": 1.5, "time/step": 2.0},
         {"rollout/rewards_mean": 0.5, "train/loss": float("nan"), "time/step": 2.5},
         {"rollout/rewards_mean": 0.75, "train/loss": 0.5, "time/step": 3.0}]


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # not the home directory's
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def tracker_config(run_dir: Path, *trackers: str, extra: tuple[str, ...] = ()):
    return load_config(overrides=[f"run_dir={run_dir}", f"logging.trackers={json.dumps(list(trackers))}",
                                  "algo.clip_eps_low=0.125", *extra])


# --- wandb's offline run file -----------------------------------------------------------------
def wandb_records(path: Path) -> list[Any]:
    """The records of a `.wandb` file as `wandb.proto.wandb_internal_pb2.Record`s. wandb 0.31 has no Python reader
    (its old `wandb.sdk.internal.datastore` went with the move to wandb-core), so this reads the framing wandb-core
    writes, the LevelDB log format: a 7-byte file header (`:W&B`, 0xBEE1, version 0), then 32 KiB blocks of chunks
    `crc32 (4) | length (2) | type (1) | data`, type 1 a whole record, 2/3/4 its first/middle/last piece; the crc
    is zlib's over the type byte and the data, checked here."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", f"{path}: not a wandb run file"
    records, pos, pending, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"{path}: bad checksum at byte {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def read_wandb_run(run_file: Path) -> tuple[str, dict[str, Any], dict[int, dict[str, Any]]]:
    """(run id, config, {step: metrics}) of one offline run file."""
    run_id, config, history = "", {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(row["_step"]), {}).update(row)
    return run_id, config, history


def wandb_exit_code(run_file: Path) -> int:
    (code,) = [r.exit.exit_code for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    return code


def wandb_run_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


# --- tests --------------------------------------------------------------------------------------
def test_import_rlsys_imports_no_tracker_library():
    code = ("import sys, rlsys, rlsys.trackers, rlsys.config, rlsys.metrics; "
            "print(sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import rlsys imported {out.strip()}"


def test_a_tracker_whose_package_is_missing_is_a_config_error(monkeypatch, tmp_path):
    from rlsys import trackers

    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "wandb", ("rlsys_no_such_module", "pip install wandb"))
    with pytest.raises(ConfigError, match=r"logging\.trackers.*pip install wandb"):
        tracker_config(tmp_path, "wandb")
    with pytest.raises(ConfigError, match="named twice"):
        tracker_config(tmp_path, "mlflow", "mlflow")
    with pytest.raises(ConfigError, match="logging.trackers"):
        tracker_config(tmp_path, "comet")


def test_mlflow_sink_logs_every_step_the_config_and_resumes_the_same_run(tmp_path):
    from mlflow.tracking import MlflowClient

    from rlsys.metrics import MetricsLogger
    from rlsys.trackers import open_trackers

    cfg = tracker_config(tmp_path, "mlflow")
    logger = MetricsLogger(tmp_path, None, sinks=open_trackers(cfg, tmp_path))
    logger.log(0, {**STEPS[0], "error/bad(label)": 1.0})  # an outcome label with characters MLflow refuses
    logger.log(1, STEPS[1])
    logger.log_eval(2, "step2", {"eval/rewards_mean": 0.9})
    logger.close()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    uri = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    assert ids["mlflow_tracking_uri"] == uri

    # a resumed run (from the step-1 checkpoint) continues the same MLflow run and fails
    logger = MetricsLogger(tmp_path, None, start_step=1, sinks=open_trackers(cfg, tmp_path, start_step=1))
    with pytest.raises(RuntimeError):
        try:
            for step in (1, 2):
                logger.log(step, STEPS[step])
            raise RuntimeError("the job broke")
        finally:
            logger.close()
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == ids["mlflow"]

    client = MlflowClient(uri)
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FAILED"
    assert run.info.run_name == tmp_path.name
    history = [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "rollout/rewards_mean")]
    # step 1 twice: the first part's and the resumed part's (MLflow keeps both)
    assert sorted(history) == [(0, 0.25), (1, 0.5), (1, 0.5), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "train/loss")] == [(0, 1.5), (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "eval/rewards_mean")] == [(2, 0.9)]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "error/bad_label_")] == [(0, 1.0)]
    params = run.data.params
    assert params["algo.clip_eps_low"] == "0.125"
    assert params["logging.trackers"] == '["mlflow"]'
    assert params["run_dir"] == str(tmp_path)


def test_wandb_offline_sink_writes_every_step_and_the_config_and_resumes_the_same_id(tmp_path):
    from rlsys.metrics import MetricsLogger
    from rlsys.trackers import open_trackers

    cfg = tracker_config(tmp_path, "wandb", extra=("logging.run_name=tiny-run",))
    logger = MetricsLogger(tmp_path, None, sinks=open_trackers(cfg, tmp_path))
    for step, metrics in enumerate(STEPS[:2]):
        logger.log(step, metrics)
    logger.log_eval(2, "step2", {"eval/rewards_mean": 0.9})
    logger.close()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]

    (first,) = wandb_run_files(tmp_path)
    got_id, config, history = read_wandb_run(first)
    assert got_id == run_id, f"{first}: run id {got_id!r} (an incomplete run file?)"
    assert config["algo.clip_eps_low"] == 0.125 and config["logging.trackers"] == ["wandb"]
    assert config["logging.run_name"] == "tiny-run"
    assert {step: row["rollout/rewards_mean"] for step, row in history.items() if "rollout/rewards_mean" in row} \
        == {0: 0.25, 1: 0.5}
    assert "train/loss" not in history[1], "a NaN went to W&B (TensorBoard leaves it out)"
    assert history[2]["eval/rewards_mean"] == 0.9

    assert wandb_exit_code(first) == 0

    # resumed from the step-2 checkpoint, then failing: the same run id, in a second offline run directory
    logger = MetricsLogger(tmp_path, None, start_step=2, sinks=open_trackers(cfg, tmp_path, start_step=2))
    with pytest.raises(RuntimeError):
        try:
            logger.log(2, STEPS[2])
            raise RuntimeError("the job broke")
        finally:
            logger.close()
    second = next(p for p in wandb_run_files(tmp_path) if p != first)
    got_id, _, history = read_wandb_run(second)
    assert got_id == run_id
    assert wandb_exit_code(second) == 1, "a failed run was not marked failed"
    assert history[2]["rollout/rewards_mean"] == 0.75 and history[2]["train/loss"] == 0.5
