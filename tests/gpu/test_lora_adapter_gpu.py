"""LoRA served by vLLM's own LoRA layers (`learner.lora.serve = "adapter"`, rlsys/lora.py `LoraSlots`): the engine
keeps the base untouched and one GPU slot holds the adapter; a push copies A and scale x B into that slot.

Same shape as test_lora_gpu.py (the merge path), whose helpers these reuse: one engine for the engine tests (file
order), then three steps of the job. `MEASURE` lines: the canary difference at the start and after pushes, the push
time on the tiny model, the base weights' bit equality after pushes.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.gpu.conftest import learner_on_gpu, measure, requires_gpu
from tests.gpu.test_lora_gpu import LORA
from tests.gpu.test_vllm_engine import canary, canary_diff, loop, push, sft_steps, vllm_view_of  # noqa: F401
from tests.gpu.test_vllm_job import gpu_job_config, ray_gpu  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]

ADAPTER = [*LORA, "learner.lora.serve=adapter"]


@pytest.fixture(scope="module")
def adapter_cfg(gpu_tiny_path):
    from rlsys.config import load_config

    return load_config(flags={"--ckpt": gpu_tiny_path, "--lr": "1e-2"}, overrides=ADAPTER)


@pytest.fixture(scope="module")
def engine(loop, gpu_tiny_path, adapter_cfg):
    import os

    from actors.rollout import lora_adapter
    from rlsys.engines.vllm_engine import VLLMEngine, device_total_bytes, memory_fraction

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process uses CUDA too (the learner)

    async def build():
        eng = VLLMEngine(gpu_tiny_path, max_batch_size=32, seed=0, dtype="bfloat16",
                         gpu_memory_utilization=memory_fraction(6.0, device_total_bytes()),
                         kv_cache_bytes=1 << 30, max_model_len=1024, enforce_eager=True,
                         lora_adapter=lora_adapter(adapter_cfg.learner.lora))
        await eng.set_lora(adapter_cfg.learner.lora.scale())
        return eng

    eng = loop.run_until_complete(build())
    yield eng
    loop.run_until_complete(eng.shutdown())


@pytest.fixture(scope="module")
def learner(gpu_tiny_path, adapter_cfg):
    with learner_on_gpu(adapter_cfg, gpu_tiny_path) as lrn:
        yield lrn


@pytest.fixture(scope="module")
def tol(adapter_cfg):
    from jobs.placement import canary_tolerance

    return canary_tolerance(adapter_cfg.model, adapter_cfg.learner, gpu=True)


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
    times = []
    for _ in range(5):
        sft_steps(learner, canary, steps=1)
        start = time.perf_counter()
        assert push(loop, engine, learner) == learner.num_parameters()
        times.append((time.perf_counter() - start) * 1e3)
    measure("lora_slots_push_ms_median_tiny", sorted(times)[len(times) // 2])
    measure("lora_slots_push_worker_ms_tiny", engine.last_load["worker_ms"])
    assert canary_diff(loop, engine, learner, canary) <= tol  # written, not added: no drift after six pushes


def test_sleep_wake_keeps_the_slot_and_a_skipped_push_shows(loop, engine, learner, canary, tol):
    loop.run_until_complete(engine.sleep(1))
    loop.run_until_complete(engine.wake(["weights"]))
    sft_steps(learner, canary, sign=-1.0)
    loop.run_until_complete(engine.wake(["kv_cache"]))
    stale = canary_diff(loop, engine, learner, canary)
    assert stale > tol, f"a skipped adapter push left the canary within tolerance ({stale:.3g})"
    loop.run_until_complete(engine.sleep(1))
    loop.run_until_complete(engine.wake(["weights"]))
    push(loop, engine, learner)
    loop.run_until_complete(engine.wake(["kv_cache"]))
    loop.run_until_complete(engine.reset_prefix_cache())
    diff = canary_diff(loop, engine, learner, canary)
    measure("lora_slots_canary_diff_after_sleep1", diff)
    assert diff <= tol


def test_three_adapter_served_steps_of_the_job_on_the_gpu(ray_gpu, tmp_path, gpu_tiny_path):  # noqa: F811
    from jobs.train import run_training
    from rlsys.metrics import read_metrics

    run_dir = run_training(gpu_job_config(tmp_path, gpu_tiny_path, *ADAPTER, **{"--lr": "1e-2"}))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        measure(f"lora_slots_job_step{r['step']}_sync_s", r["time/sync"])
        measure(f"lora_slots_job_step{r['step']}_logp_diff", r["train/logp_diff_mean"])
