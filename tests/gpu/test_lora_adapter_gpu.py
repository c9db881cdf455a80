"""LoRA served by vLLM's own LoRA layers (`learner.lora.serve = "adapter"`, rlsys/lora.py `LoraSlots`): the engine
keeps the base untouched and one GPU slot holds the adapter; a push copies A and scale x B into that slot.

Same shape as test_lora_gpu.py (the merge path), whose helpers these reuse: one engine for the engine tests (file
order), then three steps of the job. `MEASURE` lines: the canary difference at the start and after pushes, the push
time on the tiny model, the base weights' bit equality after pushes.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import measure, requires_gpu
from tests.gpu.test_lora_gpu import (  # noqa: F401 (fixtures, built on this module's lora_cfg)
    LORA, engine, later_pushes_do_not_accumulate, learner, sleep_wake_keeps_the_adapter_and_a_skipped_push_shows, tol)
from tests.gpu.test_vllm_engine import canary, canary_diff, loop, push, sft_steps, vllm_view_of  # noqa: F401
from tests.gpu.test_vllm_job import MIN_SHIFT, gpu_job_config, ray_gpu  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]

ADAPTER = [*LORA, "learner.lora.serve=adapter"]


@pytest.fixture(scope="module")
def lora_cfg(gpu_tiny_path):
    """The config the imported fixtures (engine, learner, tol) build from: test_lora_gpu.py's, served by vLLM."""
    from rlsys.config import load_config

    return load_config(flags={"--ckpt": gpu_tiny_path, "--lr": "1e-2"}, overrides=ADAPTER)


def base_weights_unchanged(loop, engine, model_path: str) -> int:
    """Asserts that every weight vLLM holds is the checkpoint's, bit for bit (LoRA layers name theirs
    `<module>.base_layer.weight`); returns how many were compared."""
    from safetensors.torch import load_file

    hf = {n: t.to(torch.bfloat16) for n, t in load_file(f"{model_path}/model.safetensors").items()}
    got = loop.run_until_complete(engine.fetch_weights())
    compared = 0
    for name, tensor in got.items():
        if ".lora_" in name:
            continue
        want = vllm_view_of(hf, name.replace(".base_layer.", "."))
        have = tensor[: want.shape[0]] if want.dim() and tensor.shape[0] > want.shape[0] else tensor  # padded vocab
        assert torch.equal(have, want), f"{name}: the base changed under adapter serving"
        compared += 1
    return compared


def test_the_zero_adapter_serves_the_base(loop, engine, learner, canary, tol):
    diff = canary_diff(loop, engine, learner, canary)  # B = 0 on both sides
    measure("lora_slots_canary_diff_start", diff)
    assert diff <= tol


def test_an_adapter_push_lands_in_the_slot_and_the_base_stays(loop, engine, learner, canary, tol, gpu_tiny_path):
    sft_steps(learner, canary)
    stale = canary_diff(loop, engine, learner, canary)
    assert stale > tol, f"training moved the canary by only {stale:.3g}: a skipped push would go unseen"
    assert push(loop, engine, learner) == learner.num_parameters()
    assert engine.last_load["path"] == "lora_slots" and engine.last_load["kept_base_mib"] == 0, engine.last_load
    diff = canary_diff(loop, engine, learner, canary)
    measure("lora_slots_canary_diff_after_push", diff)
    assert diff <= tol
    measure("lora_slots_base_weights_compared", base_weights_unchanged(loop, engine, gpu_tiny_path))
    fingerprint = loop.run_until_complete(engine.weights_fingerprint())
    assert fingerprint and set(fingerprint) == {n for n, _ in learner._pushed()}


def test_later_pushes_replace_the_adapter(loop, engine, learner, canary, tol):
    later_pushes_do_not_accumulate(loop, engine, learner, canary, tol, "lora_slots")


def test_sleep_wake_keeps_the_slot_and_a_skipped_push_shows(loop, engine, learner, canary, tol):
    sleep_wake_keeps_the_adapter_and_a_skipped_push_shows(loop, engine, learner, canary, tol, "lora_slots")


def test_three_adapter_served_steps_of_the_job_on_the_gpu(ray_gpu, tmp_path, gpu_tiny_path):  # noqa: F811
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    run_dir = run_training(gpu_job_config(tmp_path, gpu_tiny_path, *ADAPTER, **{"--lr": "1e-2"}))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        measure(f"lora_slots_job_step{r['step']}_sync_s", r["time/sync"])
        measure(f"lora_slots_job_step{r['step']}_logp_diff", r["train/logp_diff_mean"])


# the sampled tokens' |engine - learner| logprob, mean over a step: 0.0012-0.0016 eager (the test above, ea9da70);
# an engine that sampled with a stale adapter after a push at lr 1e-2 reads far above it (a skipped push: the canary
# ~4 after a few steps, test_lora_gpu.py)
GRAPH_LOGP_DIFF_MAX = 0.05


def test_the_slot_under_cuda_graphs_of_decode(ray_gpu, tmp_path, gpu_tiny_path):  # noqa: F811
    """The slot with full CUDA graphs of decode batches (`rollout.graph_mode = "full_decode"`, the GPU recipe's mode):
    a push copies into the slot's tensors in place, so the captured graphs read the new adapter. The canary scores
    a prompt (prefill, eager in this mode); the sampled tokens' logprobs come from the graphs' decode, so their
    agreement with the learner's after every push is what says the graphs serve the pushed adapter."""
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    run_dir = run_training(gpu_job_config(tmp_path, gpu_tiny_path, *ADAPTER, "rollout.enforce_eager=false",
                                          "rollout.graph_mode=full_decode", "rollout.engine_max_batch=16",
                                          **{"--lr": "1e-2"}))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        measure(f"lora_slots_graphs_step{r['step']}_logp_diff", r["train/logp_diff_mean"])
        measure(f"lora_slots_graphs_step{r['step']}_sync_s", r["time/sync"])
        assert r["train/logp_diff_mean"] <= GRAPH_LOGP_DIFF_MAX, (r["step"], r["train/logp_diff_mean"])
        assert r["sync/canary_engine_shift"] > MIN_SHIFT, (r["step"], r["sync/canary_engine_shift"])
