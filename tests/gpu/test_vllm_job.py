"""The job on the GPU: Ray placement group, vLLM rollout actor, bf16 learner, CUDA IPC push, and pushes that fail.

Three steps through `jobs.train.run_training`, as `rlsys train` runs them: every step sleeps the engine (level 1,
level 2, or not at all: `awake`, what `rollout.keep_awake = auto` picks under the budget), trains, pushes by CUDA
IPC (count checked), wakes it and runs the canary, which raises if the push went wrong.
`ray`: the same with vLLM's Ray executor (`rollout.executor = "ray"`: the worker is a Ray actor in the job's
placement group, beside the learner, fed a `PerGpuPayload`), the tensor-parallel path at tp_size 1.
`fp32master`: fp32 master weights under bf16 autocast against the bf16 engine, with the default canary tolerance.
`overlap`: `rollout.overlap`, vLLM awake and sampling the next step's batch while the learner trains beside it.

The reward trains (tests/loop's: spread within every group, so every step has advantages and a gradient), and
after every push the engine's logprobs on the canary's fixed sequence must have moved from the previous push's
(`sync/canary_engine_shift`) while matching the learner's: a push that never landed cannot pass as a healthy one,
as it could when the random model's tic-tac-toe reward was -1 everywhere and nothing trained.
The fault tests make the second push skip (an engine that reports the count without loading: the fingerprint or the
canary; with `sync.canary_every = 10`, the fingerprint alone) or lose a bucket (with fp32 masters, whose canary
tolerance is the loosest: the count check), and that step must fail.
"""
from __future__ import annotations

import math
import os

import pytest

from tests.gpu.conftest import REPO, measure, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]
PLUGINS = REPO / "tests" / "loop" / "plugins"
MIN_SHIFT = 1e-3  # mean |change| of the engine's canary logprobs per push at lr 1e-3 (0 when a push is skipped)


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


def gpu_job_config(tmp_path, gpu_tiny_path, *overrides: str, **flags):
    from rlsys.config import load_config

    flags = {"--max-steps": "3", "--run-dir": str(tmp_path / "run"), "--ckpt": gpu_tiny_path, "--engine": "vllm",
             "--batch-size": "4", "--n-samples": "4", "--max-new-tokens": "32", "--mini-bs": "4", "--lr": "1e-3",
             "--agent-fn": str(PLUGINS / "recording_agent.py"), "--reward-fn-path": str(PLUGINS / "length_reward.py"),
             **flags}
    return load_config(flags=flags, overrides=[
        "logging.progress=false", "data.num_items=64", "rollout.enforce_eager=true",
        "rollout.gpu_memory_budget_gib=6.0", "rollout.max_model_len=1024", *overrides,
        # a fixed KV cache: no start-up memory profile, which fails whenever another process on the GPU (a parallel
        # test, a training run) allocates or frees memory meanwhile (vLLM's "Error in memory profiling")
        "rollout.kv_cache_gib=1"])


@pytest.mark.parametrize("drop_rollout_state, executor, keep_awake, fp32_master, overlap", [
    (False, "auto", "false", False, False), (True, "auto", "auto", False, False), (False, "ray", "auto", False, False),
    (False, "auto", "auto", False, False), (False, "auto", "auto", True, False), (False, "auto", "auto", False, True)],
    ids=["sleep1", "sleep2", "ray", "awake", "fp32master", "overlap"])
def test_three_trained_steps_on_the_gpu_with_vllm(ray_gpu, tmp_path, gpu_tiny_path, drop_rollout_state, executor,
                                                  keep_awake, fp32_master, overlap, capfd):
    from jobs.placement import canary_tolerance
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    flags = {"--drop-rollout-state": True} if drop_rollout_state else {}
    cfg = gpu_job_config(tmp_path, gpu_tiny_path, f"rollout.executor={executor}", f"rollout.keep_awake={keep_awake}",
                         f"learner.fp32_master={str(fp32_master).lower()}",
                         f"rollout.overlap={str(overlap).lower()}", **flags)
    tol = canary_tolerance(cfg.model, cfg.learner, gpu=True)  # the default the job runs with (sync.canary_tol unset)
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
           else "fp32master" if fp32_master else "overlap" if overlap else "awake")
    for r in rows:
        for key in ("sync/canary_logp_diff", "sync/canary_engine_shift", "train/logp_diff_mean", "train/grad_norm",
                    "time/canary", "time/rollout_sampling", "time/rollout_wait",
                    "rollout/rewards_std", "time/sync", "time/sleep", "time/wake", "time/rollout", "time/train",
                    "perf/tokens_per_s"):
            if key in r and math.isfinite(r[key]):
                measure(f"job_{tag}_step{r['step']}_{key}", r[key])
    for r in rows:
        assert r["sync/tensors"] > 0
        assert r["train/skipped_steps"] == 0
        assert r["train/grad_norm"] > 0, "the reward gave no gradient: nothing would move the engine"
        # the push landed: the engine matches the learner and moved since the last push, by more than it disagrees
        assert r["sync/canary_logp_diff"] <= tol, (r["step"], r["sync/canary_logp_diff"], tol)
        shift = r["sync/canary_engine_shift"]
        assert shift > max(MIN_SHIFT, r["sync/canary_logp_diff"]), (r["step"], shift, r["sync/canary_logp_diff"])
        # and its bits are the learner's: the copy plan of the first push lets the engine fingerprint every push
        assert r.get("sync/fingerprinted") == 1.0, (r["step"], r.get("sync/fingerprinted"))
    # the stale-weights alarm: vLLM's sampling logprobs vs the learner's recomputation; with rollout.overlap from the
    # second step on the batch was sampled one update earlier (vLLM generating beside the learner, awake)
    on_policy = rows[:1] if overlap else rows
    assert all(r.get("train/logp_diff_mean", 0.0) < 0.05 for r in on_policy), \
        [r.get("train/logp_diff_mean") for r in rows]
    if overlap:
        assert [r["rollout/off_policy_steps"] for r in rows] == [0.0, 1.0, 1.0]
    assert (run_dir / "checkpoints" / "step_000003" / "model.safetensors").is_file()


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn


class _EngineThatSkips:
    """A rollout actor whose `load_weights` reports the expected count without loading: a push that never landed."""

    def __init__(self, handle, count: int) -> None:
        import ray

        self._handle = handle
        self.load_weights = _Remote(lambda payload: ray.put(count))

    def __getattr__(self, name):
        return getattr(self._handle, name)


class _LearnerThatLosesABucket:
    """A learner whose CUDA IPC payload lacks its last bucket: a partial push."""

    def __init__(self, handle) -> None:
        import ray

        self._handle = handle
        self.export_weights = _Remote(lambda *args: ray.put(ray.get(handle.export_weights.remote(*args))[:-1]))

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.mark.parametrize("fault, fp32_master, canary_every, error", [
    # the fingerprint reads the engine's stale bits (once the copy plan exists: from the first push on)
    ("skip", False, 1, "weight fingerprint: engine 0 holds|stale-weights canary: engine 0"),
    # with the canary every 10th push only (the start's check runs), the fingerprint alone catches it on its step
    ("skip", False, 10, r"weight fingerprint: engine 0 holds \d+ of the \d+ pushed tensors"),
    # the worker's direct copy refuses a short push itself; before its plan exists, the driver's count check does
    ("partial", True, 1, r"direct copy: \d+ tensors sent, \d+ planned|engine 0 loaded \d+ tensors, the learner sent")],
    ids=["skip", "skip-between-canaries", "partial"])
def test_a_skipped_or_partial_push_fails_its_step(ray_gpu, tmp_path, gpu_tiny_path, monkeypatch, fault, fp32_master,
                                                  canary_every, error):
    from jobs.weight_sync import WeightSync
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    # 1 MiB buckets: the tiny model's weights take several, so a partial push can lose one
    cfg = gpu_job_config(tmp_path, gpu_tiny_path, f"learner.fp32_master={str(fp32_master).lower()}", "sync.bucket_mb=1",
                         f"sync.canary_every={canary_every}")
    push, pushes = WeightSync.push, []

    def faulty_push(self):
        pushes.append(len(pushes) + 1)
        if len(pushes) != 2:  # the second push (step 1) goes wrong
            return push(self)
        engines, learners = self.engines, self.learners
        if fault == "skip":
            self.engines = [_EngineThatSkips(e, self.expected_count) for e in engines]
        else:
            self.learners = [_LearnerThatLosesABucket(rank) for rank in learners]
        try:
            return push(self)
        finally:
            self.engines, self.learners = engines, learners

    monkeypatch.setattr(WeightSync, "push", faulty_push)
    with pytest.raises(Exception, match=error):  # a RuntimeError, or the worker's error through Ray and vLLM
        run_training(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0], "step 0 is healthy; the faulty push of step 1 must fail that step"
    if "sync/canary_logp_diff" in rows[0]:  # with canary_every 10, only if step 0's push went unfingerprinted
        every = "" if canary_every == 1 else f"_every{canary_every}"
        measure(f"job_fault_{fault}{every}_step0_canary", rows[0]["sync/canary_logp_diff"])
