"""The tic-tac-toe job on the GPU: Ray placement group, vLLM rollout actor, bf16 learner, CUDA IPC push.

Three steps through `jobs.train.run_training`, as `rlsys train` runs them: every step sleeps the engine (level 1,
level 2, or not at all: `awake`, what `rollout.keep_awake = auto` picks under the budget), trains, pushes by CUDA
IPC (count checked), wakes it and runs the canary, which raises if the push went wrong.
`ray`: the same with vLLM's Ray executor (`rollout.executor = "ray"`: the worker is a Ray actor in the job's
placement group, beside the learner, fed a `PerGpuPayload`), the tensor-parallel path at tp_size 1.
"""
from __future__ import annotations

import math
import os

import pytest

from tests.gpu.conftest import REPO, measure, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]


@pytest.fixture
def ray_gpu():
    # one Ray per job: a finished job's placement group keeps its GPU bundle until Ray goes away
    import ray

    if not ray.is_initialized():
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ray.init(address="local", num_gpus=1, num_cpus=min(8, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=True, runtime_env={"env_vars": {"PYTHONPATH": path, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("drop_rollout_state, executor, keep_awake", [
    (False, "auto", "false"), (True, "auto", "auto"), (False, "ray", "auto"), (False, "auto", "auto")],
    ids=["sleep1", "sleep2", "ray", "awake"])
def test_three_tictactoe_steps_on_the_gpu_with_vllm(ray_gpu, tmp_path, gpu_tiny_path, drop_rollout_state, executor,
                                                    keep_awake, capfd):
    from jobs.placement import BF16_CANARY_TOL
    from jobs.train import run_training
    from rlsys.config import load_config
    from rlsys.metrics import read_metrics

    flags = {"--max-steps": "3", "--run-dir": str(tmp_path / "run"), "--ckpt": gpu_tiny_path, "--engine": "vllm",
             "--batch-size": "4", "--n-samples": "4", "--max-new-tokens": "32", "--mini-bs": "4", "--lr": "1e-4"}
    if drop_rollout_state:
        flags["--drop-rollout-state"] = True
    cfg = load_config(flags=flags, overrides=[
        "logging.progress=false", "data.num_items=64", "rollout.enforce_eager=true",
        "rollout.gpu_memory_budget_gib=6.0", "rollout.max_model_len=1024", f"rollout.executor={executor}",
        f"rollout.keep_awake={keep_awake}"])
    run_dir = run_training(cfg)
    out = capfd.readouterr().out
    if executor == "ray":  # the driver's transport line names the Ray worker fed by the rank on its GPU
        assert "learner-0 -> rollout-0: cuda_ipc (1 vLLM Ray worker(s), each on a learner rank's GPU)" in out
    # keep_awake auto under a budget: awake (the budget caps both); sleep levels as asked otherwise
    expected = ("sleep at level 2" if drop_rollout_state else "sleep at level 1" if keep_awake == "false"
                else "stay awake")
    assert f"rlsys: engines {expected} while the learner trains" in out

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    tag = ("ray" if executor == "ray" else "sleep2" if drop_rollout_state else "sleep1" if keep_awake == "false"
           else "awake")
    for r in rows:
        assert r["sync/tensors"] > 0
        assert r["sync/canary_logp_diff"] <= BF16_CANARY_TOL
        for key in ("sync/canary_logp_diff", "train/logp_diff_mean", "time/sync", "time/sleep", "time/wake",
                    "time/rollout", "time/train", "perf/tokens_per_s"):
            if key in r and math.isfinite(r[key]):
                measure(f"job_{tag}_step{r['step']}_{key}", r[key])
    assert all(r["train/skipped_steps"] == 0 for r in rows)
    # the stale-weights alarm: vLLM's sampling logprobs vs the learner's recomputation, bf16 on both sides
    assert all(r.get("train/logp_diff_mean", 0.0) < 0.05 for r in rows), [r.get("train/logp_diff_mean") for r in rows]
    assert (run_dir / "checkpoints" / "step_000003" / "model.safetensors").is_file()
