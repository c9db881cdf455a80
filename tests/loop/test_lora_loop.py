"""The tic-tac-toe job with LoRA on CPU (`learner.lora`): only the adapters train, a push carries only them, the
engine merges them (its logprobs equal the learner's after every push), the canary catches a skipped push, and a
resumed job starts its engine on the checkpoint's adapter; `rlsys export --merge` turns a checkpoint into a model."""
from __future__ import annotations

import pytest
import torch

from tests.loop.conftest import PLUGINS, job_config

pytestmark = pytest.mark.timeout(400)

LORA = ["learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.alpha=8"]
PLUGIN_FILES = {"agent_fn": str(PLUGINS / "recording_agent.py"), "reward_fn_path": str(PLUGINS / "length_reward.py")}


def _step(job, step: int, push: bool = True) -> None:
    import ray

    items = job.data.next_batch(job.cfg.rollout.batch_size)
    traj_refs, summaries = job.rollout(items, step=step)
    job.engines.sleep(level=1)
    stats = job.train(traj_refs, summaries)
    assert stats["train/skipped_steps"] == 0
    if push:
        job.weights.push()  # wakes the weights, then loads
    else:  # the push's wake without its load
        ray.get([rollout.wake.remote(["weights"]) for rollout in job.rollouts])
    job.engines.wake()


def test_lora_job_trains_only_adapters_and_the_engine_matches_the_learner_after_each_push(ray_local, tmp_path,
                                                                                         tiny_model_path):
    import ray

    from jobs.job import Job

    cfg = job_config(tmp_path, *LORA, lr="1e-2", **PLUGIN_FILES)
    job = Job.start(cfg)
    try:
        learner, rollout = job.learner, job.rollouts[0]
        start = ray.get(learner.named_weights.remote())
        trainable = set(ray.get(learner.trainable_names.remote()))
        engine_start = ray.get(rollout.named_weights.remote())
        assert ray.get(learner.num_parameters.remote()) == len(trainable) == job.weights.expected_count
        prompt, continuation = job.weights.canary_prompt, job.weights.canary_continuation
        for step in range(2):
            _step(job, step)
            job.weights.check_canary()
            ours, theirs = ray.get([learner.score.remote(prompt, continuation),
                                    rollout.score.remote(prompt, continuation)])
            diff = max(abs(a - b) for a, b in zip(ours, theirs))
            assert diff < 1e-4, f"step {step}: engine logprobs differ from the learner's by {diff:.3g}"

        now = ray.get(learner.named_weights.remote())
        changed = {n for n in start if not torch.equal(start[n], now[n])}
        assert changed <= trainable, f"frozen weights moved: {sorted(changed - trainable)[:3]}"
        assert {n for n in trainable if ".lora_B." in n} <= changed, "every lora_B must have moved from zero"

        # the engine's weights: base + (alpha / r) B A on the targeted layers, the base everywhere else
        engine = ray.get(rollout.named_weights.remote())
        scale = cfg.learner.lora.scale()
        merged = set()
        for name in trainable:
            if ".lora_A." not in name:
                continue
            module = name.split(".lora_A.")[0]
            a, b = now[name], now[name.replace(".lora_A.", ".lora_B.")]
            want = engine_start[f"{module}.weight"] + scale * b @ a
            torch.testing.assert_close(engine[f"{module}.weight"], want, atol=1e-6, rtol=1e-5)
            merged.add(f"{module}.weight")
        for name, tensor in engine.items():
            if name not in merged:
                assert torch.equal(tensor, engine_start[name]), f"{name} is not a target but changed in the engine"

        # a step whose adapter never reaches the engine: the canary refuses to go on
        _step(job, 2, push=False)
        with pytest.raises(RuntimeError, match="stale-weights canary"):
            job.weights.check_canary()
    finally:
        job.shutdown()


def test_lora_checkpoint_resumes_with_the_adapter_on_the_engine_and_exports_merged(ray_local, tmp_path,
                                                                                    tiny_model_path):
    from transformers import AutoModelForCausalLM

    from jobs.train import run_training
    from rlsys.cli import main as rlsys_main
    from rlsys.metrics import read_metrics

    run_dir = run_training(job_config(tmp_path, *LORA, lr="1e-2", max_steps="2", **PLUGIN_FILES))
    ckpt = run_dir / "checkpoints" / "step_000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "learner_state.pt").is_file()
    assert not (ckpt / "model.safetensors").exists()

    run_training(job_config(tmp_path, *LORA, "checkpoint.resume=auto", lr="1e-2", max_steps="3", **PLUGIN_FILES))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the resumed step sampled from base + the checkpoint's adapter: had the engine started on the bare base, the
    # learner (which loaded the adapter) would disagree with its sampling logprobs
    assert rows[2]["train/logp_diff_mean"] < 1e-4, rows[2]["train/logp_diff_mean"]
    assert rows[2]["train/optimizer_steps"] == 3, "the optimizer state was not restored"

    out = tmp_path / "merged"
    assert rlsys_main(["export", "--merge", str(run_dir / "checkpoints" / "step_000003"), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        assert not torch.allclose(merged(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
