"""Crash and stop, for real: a driver killed with SIGKILL resumes from its last checkpoint and redoes the
same steps with the same metrics; SIGTERM (what `ray job stop` sends) checkpoints before exiting."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import PLUGINS, REPO

pytestmark = pytest.mark.timeout(600)

ARGS = ["--config", "configs/tictactoe-tiny-cpu.toml", "--agent-fn", str(PLUGINS / "recording_agent.py"),
        "--reward-fn-path", str(PLUGINS / "length_reward.py"), "--max-steps", "5", "--save-interval", "2",
        "--batch-size", "2", "--n-samples", "4", "--max-new-tokens", "16", "--lr", "1e-3",
        "logging.progress=false", "data.num_items=64"]


def _driver(ray_local, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    return subprocess.Popen([sys.executable, "-m", "jobs.train", *ARGS, "--run-dir", str(run_dir), *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 300) -> None:
    from rlsys.metrics import read_metrics

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        f = run_dir / "metrics.jsonl"
        if f.is_file() and any(r["step"] >= step for r in read_metrics(f)):
            return
        if proc.poll() is not None:
            pytest.fail(f"driver exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no metrics for step {step} after {timeout_s} s")


# What a run decides (sampled tokens -> rewards, outcomes, lengths; data order; optimizer steps) must be
# identical. Learner floats may differ in the last bits: the engine batches concurrent requests as they
# arrive, and batch shape changes logprobs by ~1e-7 (measured), which moves loss/ratio/logp_diff that much.
EXACT = ("rollout/", "error/", "adv/", "train/num_sequences", "train/skipped", "train/optimizer_steps", "train/lr")


NOT_COMPARED = ("time/", "perf/", "startup/")  # wall clocks; startup/* is logged at the first step of each start


def _assert_same_step(row: dict, expected: dict) -> None:
    compared = lambda d: {k for k in d if not k.startswith("startup/")}  # noqa: E731
    assert compared(row) == compared(expected)
    for key, value in row.items():
        if key.startswith(NOT_COMPARED):
            continue
        if key.startswith(EXACT) or key == "step":
            assert value == expected[key], f"step {row['step']}: {key} {value} != {expected[key]}"
        else:
            assert value == pytest.approx(expected[key], rel=1e-3, abs=1e-5), f"step {row['step']}: {key}"


def test_sigkill_then_resume_auto_repeats_the_uninterrupted_run(ray_local, tmp_path):
    from jobs.train import run_training
    from rlsys.config import load_config
    from rlsys.metrics import read_metrics

    reference = tmp_path / "reference"
    proc = _driver(ray_local, reference)
    assert proc.wait(timeout=400) == 0, proc.stdout.read()
    expected = {r["step"]: r for r in read_metrics(reference / "metrics.jsonl")}

    crashed = tmp_path / "crashed"
    proc = _driver(ray_local, crashed)
    _wait_for_step(proc, crashed, 2)  # steps 0-2 done, checkpoint step_000002 written after step 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpts = crashed / "checkpoints"
    resumed_at = int((ckpts / "latest").read_text().strip().split("_")[1])
    assert resumed_at in (2, 4)

    proc = _driver(ray_local, crashed, "--resume", "auto")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    assert f"resumed from {ckpts / f'step_{resumed_at:06d}'} at step {resumed_at}" in out
    rows = read_metrics(crashed / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # redone steps replace the crashed run's rows
    for row in rows:
        _assert_same_step(row, expected[row["step"]])


def test_sigterm_checkpoints_the_finished_step_and_exits(ray_local, tmp_path):
    from rlsys.checkpoint import find_resume, read_trainer_state
    from rlsys.metrics import read_metrics

    run_dir = tmp_path / "stopped"
    proc = _driver(ray_local, run_dir, "--max-steps", "50", "--save-interval", "0")
    _wait_for_step(proc, run_dir, 0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "stopped by SIGTERM" in out
    last = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    ckpt = find_resume("auto", run_dir / "checkpoints")
    assert ckpt is not None and read_trainer_state(ckpt)["step"] == last + 1
    assert (ckpt / "learner_state.pt").is_file() and (ckpt / "model.safetensors").is_file()
    # written with the user's umask: nothing in the run directory is world-writable
    writable = [p for p in [run_dir, *run_dir.rglob("*")] if p.stat().st_mode & 0o002]
    assert writable == []
