"""vLLM engine + CUDA IPC weight push + sleep/wake, against a learner on the same GPU (no Ray).

One engine serves the whole module (a cold start costs ~1 min), so the tests run in file order and each
leaves the engine awake with the learner's current weights. The learner is the real `actors.learner.Learner`
(bf16 on the GPU); "training" is a few SFT steps on the canary sequence, which moves its logprobs far more
than the bf16 tolerance, so a skipped push is visible.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.gpu.conftest import learner_on_gpu, measure, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(600)]

BUCKET_BYTES = 1 << 20  # 1 MiB: the tiny model spreads over several buckets, as a real model does


# ------------------------------------------------------------------ module fixtures
@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, gpu_tiny_path):
    import os

    from rlsys.engines.vllm_engine import VLLMEngine, device_total_bytes, memory_fraction

    # this process uses CUDA itself (the learner): vLLM's engine core must be spawned, not forked
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    async def build():
        return VLLMEngine(gpu_tiny_path, max_batch_size=32, seed=0, dtype="bfloat16",
                          gpu_memory_utilization=memory_fraction(6.0, device_total_bytes()),
                          kv_cache_bytes=1 << 30,  # fixed: no profiling of a GPU that other runs share
                          max_model_len=1024, enforce_eager=True)

    start = time.perf_counter()
    eng = loop.run_until_complete(build())
    measure("engine_start_s", time.perf_counter() - start)
    yield eng
    loop.run_until_complete(eng.shutdown())


@pytest.fixture(scope="module")
def learner(gpu_tiny_path):
    from rlsys.config import load_config

    with learner_on_gpu(load_config(flags={"--ckpt": gpu_tiny_path, "--lr": "3e-3"}), gpu_tiny_path) as lrn:
        yield lrn


@pytest.fixture(scope="module")
def canary(gpu_tiny_path):
    from jobs.weight_sync import canary_sequence

    return canary_sequence(gpu_tiny_path)


@pytest.fixture(scope="module")
def tol():
    from jobs.placement import BF16_CANARY_TOL

    return BF16_CANARY_TOL


# ------------------------------------------------------------------ helpers
def push(loop, engine, learner) -> int:
    """One push by CUDA IPC; each side keeps its transport across pushes, as in a job (rlsys/weights/routes.py)."""
    from rlsys.weights.transport import make_transport

    if not learner.sender.transports:
        learner.open_transports([make_transport("cuda_ipc")], BUCKET_BYTES)
    receiver = getattr(engine, "_test_receiver", None) or make_transport("cuda_ipc")
    engine._test_receiver = receiver
    payload = learner.export_weights()
    count = loop.run_until_complete(engine.load_payload(receiver, payload))
    learner.ipc_collect()
    return count


def canary_diff(loop, engine, learner, canary) -> float:
    prompt, cont = canary
    ref = learner.score(prompt, cont)
    got = loop.run_until_complete(engine.score(prompt, cont))
    assert len(got) == len(ref) == len(cont)
    return sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)


def sft_steps(learner, canary, steps: int = 4, sign: float = 1.0) -> None:
    """Move the learner's weights: a few optimizer steps raising the canary continuation's logprob (``sign`` -1:
    lowering it, which keeps moving the canary after repeated raising has saturated it near 0)."""
    from rlsys.algos import token_logprobs

    prompt, cont = canary
    ids = torch.tensor([prompt + cont], device=learner.device)
    learner.model.train()
    for _ in range(steps):
        logits = learner.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        lp = token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1 :]
        (-sign * lp.mean()).backward()
        learner.optimizer.step()
        learner.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def assert_greedy_matches_learner(learner, prompt: list[int], engine_tokens: list[int]) -> None:
    """The engine's greedy tokens are the learner's argmax at every position, up to the first near tie
    (top-2 logit margin < 0.1, where bf16 rounding may legitimately pick either)."""
    learner.model.eval()
    ids = torch.tensor([prompt], device=learner.device)
    try:
        for i, tok in enumerate(engine_tokens):
            logits = learner.model(input_ids=ids, use_cache=False).logits[0, -1].float()
            top2 = logits.topk(2)
            if float(top2.values[0] - top2.values[1]) < 0.1:
                print(f"greedy compared up to a near tie at position {i}", flush=True)
                return
            assert tok == int(top2.indices[0]), f"position {i}: engine {tok}, learner {int(top2.indices[0])}"
            ids = torch.cat([ids, torch.tensor([[tok]], device=learner.device)], dim=1)
    finally:
        learner.model.train()


def vllm_view_of(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What vLLM's parameter ``name`` must hold, built from the learner's HF-named weights (TP=1)."""
    if name in hf:
        return hf[name]
    for fused, shards in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return torch.cat([hf[name.replace(fused, s)] for s in shards], dim=0)
    raise KeyError(name)


def assert_engine_weights_equal_learner(loop, engine, learner) -> None:
    hf = learner.named_weights()
    got = loop.run_until_complete(engine.fetch_weights())
    assert got, "the engine reported no parameters"
    for name, tensor in got.items():
        want = vllm_view_of(hf, name)
        rows = want.shape[0] if want.dim() else None
        have = tensor[:rows] if rows is not None and tensor.shape[0] > rows else tensor  # padded vocab rows
        assert have.dtype == want.dtype and torch.equal(have, want), f"{name}: engine != learner after the push"


# ------------------------------------------------------------------ tests
def test_engine_starts_from_the_checkpoint_and_the_canary_agrees(loop, engine, learner, canary, tol):
    assert engine.max_model_len == 1024
    diff = canary_diff(loop, engine, learner, canary)
    measure("canary_diff_start", diff)
    assert diff <= tol, f"fresh engine vs learner: mean |dlogp| {diff:.3g} > {tol}"


def test_generate_returns_raw_logprobs_of_the_sampled_tokens_and_is_seeded(loop, engine, learner, canary):
    from rlsys.engines import SamplingParams

    prompt, _ = canary
    for temperature in (1.0, 0.6):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=1234)
        out = loop.run_until_complete(engine.generate(prompt, params))
        again = loop.run_until_complete(engine.generate(prompt, params))
        assert out.token_ids == again.token_ids, "same seed, same weights -> same tokens"
        assert len(out.logprobs) == len(out.token_ids) > 0
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "length":
            assert len(out.token_ids) == 12
        else:
            assert out.token_ids[-1] in engine.eos_token_ids, "the stop token stays in token_ids"
        # raw logprobs: what the learner computes at temperature 1, whatever the sampling temperature
        ref = learner.score(prompt, out.token_ids)
        diff = sum(abs(a - b) for a, b in zip(out.logprobs, ref)) / len(ref)
        measure(f"sample_logp_diff_t{temperature}", diff)
        assert diff < 0.05, f"temperature {temperature}: sampled logprobs are not the raw ones (diff {diff:.3g})"


def test_concurrent_requests_are_served_together(loop, engine, canary):
    from rlsys.engines import SamplingParams

    prompt, _ = canary

    async def many():
        params = [SamplingParams(max_new_tokens=32, temperature=1.0, seed=s) for s in range(64)]
        return await asyncio.gather(*(engine.generate(prompt, p) for p in params))

    start = time.perf_counter()
    outs = loop.run_until_complete(many())
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    measure("concurrent64_tokens_per_s", tokens / elapsed)
    assert len(outs) == 64 and all(o.token_ids for o in outs)


def test_push_after_training_makes_the_engine_equal_the_learner(loop, engine, learner, canary, tol):
    sft_steps(learner, canary)
    stale = canary_diff(loop, engine, learner, canary)
    measure("canary_diff_stale_level1", stale)
    assert stale > tol, f"training moved the canary by only {stale:.3g}: the stale-weights check would be blind"

    count = push(loop, engine, learner)
    assert count == learner.num_parameters()
    assert engine.last_load.get("missing") in ([], None), engine.last_load
    measure("push_first_rpc_ms", engine.last_load["rpc_ms"])
    diff = canary_diff(loop, engine, learner, canary)
    measure("canary_diff_after_push", diff)
    assert diff <= tol

    assert_engine_weights_equal_learner(loop, engine, learner)

    prompt, cont = canary
    from rlsys.engines import SamplingParams

    n = min(len(cont), 16)
    out = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0)))
    assert_greedy_matches_learner(learner, prompt, out.token_ids)


def test_later_pushes_reuse_the_ipc_mapping_and_copy_directly(loop, engine, learner, canary, tol):
    opened = engine.last_load["opened"]
    times = []
    for _ in range(5):
        sft_steps(learner, canary, steps=1)
        start = time.perf_counter()
        count = push(loop, engine, learner)
        times.append((time.perf_counter() - start) * 1e3)
        assert count == learner.num_parameters()
    info = engine.last_load
    print("last push:", info, flush=True)
    measure("push_ms_median_tiny", sorted(times)[len(times) // 2])
    measure("push_worker_ms_tiny", info["worker_ms"])
    assert info["opened"] == opened, "a buffer's IPC handle was opened again: the mapping cache missed"
    assert info["path"] == "direct", f"direct-copy plan refused: {info.get('plan_refused')}"
    assert canary_diff(loop, engine, learner, canary) <= tol
    assert_engine_weights_equal_learner(loop, engine, learner)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_cycle_keeps_the_weights_right(loop, engine, learner, canary, tol, level):
    from rlsys.engines import SamplingParams

    prompt, _ = canary
    start = time.perf_counter()
    loop.run_until_complete(engine.sleep(level))
    measure(f"sleep_level{level}_s", time.perf_counter() - start)
    with pytest.raises(RuntimeError, match="asleep|dropped"):
        loop.run_until_complete(engine.generate(prompt, SamplingParams(max_new_tokens=4)))
    sft_steps(learner, canary, steps=2)  # the learner trains while the engine sleeps

    start = time.perf_counter()
    loop.run_until_complete(engine.wake(["weights"]))
    measure(f"wake_weights_level{level}_s", time.perf_counter() - start)
    count = push(loop, engine, learner)
    assert count == learner.num_parameters()
    start = time.perf_counter()
    loop.run_until_complete(engine.wake(["kv_cache"]))
    loop.run_until_complete(engine.reset_prefix_cache())
    measure(f"wake_kv_level{level}_s", time.perf_counter() - start)

    assert not engine.weights_dropped and not engine.is_sleeping
    diff = canary_diff(loop, engine, learner, canary)
    measure(f"canary_diff_after_level{level}", diff)
    assert diff <= tol
    assert_engine_weights_equal_learner(loop, engine, learner)
    out = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0.0)))
    assert_greedy_matches_learner(learner, prompt, out.token_ids)


def test_a_skipped_push_after_level_2_is_refused_then_a_push_repairs_it(loop, engine, learner, canary, tol):
    loop.run_until_complete(engine.sleep(2))
    loop.run_until_complete(engine.wake(["weights"]))
    loop.run_until_complete(engine.wake(["kv_cache"]))  # no push in between: the weights are garbage
    prompt, cont = canary
    with pytest.raises(RuntimeError, match="dropped"):
        loop.run_until_complete(engine.score(prompt, cont))
    assert push(loop, engine, learner) == learner.num_parameters()
    loop.run_until_complete(engine.reset_prefix_cache())
    assert canary_diff(loop, engine, learner, canary) <= tol


def test_stop_strings_logit_bias_and_penalties_reach_vllm(loop, engine, learner, canary, gpu_tiny_path):
    """The proxy's `stop`, `logit_bias` and penalties on vLLM: generation ends with the token that completes a stop
    string (kept in token_ids, as on the CPU engine), a +100 bias decides a greedy token, and the logprobs stay the
    raw ones the learner recomputes."""
    from transformers import AutoTokenizer

    from rlsys.engines import SamplingParams

    prompt, _ = canary
    tok = AutoTokenizer.from_pretrained(gpu_tiny_path)
    free = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0)))
    assert len(free.token_ids) >= 8, free.token_ids
    k = 6  # a stop string that the 6th generated token completes
    text = tok.decode(free.token_ids[:k])
    stop = text[len(tok.decode(free.token_ids[: k - 1])):]
    if not stop.strip():
        pytest.skip(f"the tiny model's 6th greedy token decodes to whitespace ({stop!r})")
    cut = loop.run_until_complete(engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                         stop=(stop,))))
    first = next(i for i in range(1, len(free.token_ids) + 1) if stop in tok.decode(free.token_ids[:i]))
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:first], (cut.token_ids, free.token_ids)

    target = free.token_ids[0] + 1 if free.token_ids[0] + 1 < engine.vocab_size else free.token_ids[0] - 1
    biased = loop.run_until_complete(engine.generate(prompt, SamplingParams(
        max_new_tokens=4, temperature=0.0, logit_bias=((target, 100.0),), frequency_penalty=2.0, presence_penalty=1.0)))
    assert biased.token_ids[0] == target
    ref = learner.score(prompt, biased.token_ids)
    diff = sum(abs(a - b) for a, b in zip(biased.logprobs, ref)) / len(ref)
    measure("biased_logp_diff", diff)
    assert diff < 0.05, f"logprobs under bias and penalties are not the raw ones (diff {diff:.3g})"
