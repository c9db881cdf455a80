"""TransformersEngine against a plain uncached forward loop on a tiny random Qwen2 model.

The model is built here (vocab 128, hidden 32, 2 layers, tied embeddings, a wide init so greedy
outputs are not one token repeated) so these tests do not depend on rlsys's tiny model.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlsys.engines import make_engine
from rlsys.engines.base import SamplingParams
from rlsys.engines.hf_loop import sample_rows
from rlsys.engines.transformers_engine import TransformersEngine

EOS = 1
MAX_POS = 64
PROMPTS = [  # 8 prompts of different lengths
    [5, 6, 7, 8, 9, 10, 11],
    [3, 4],
    [12, 13, 14, 15],
    [100],
    [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
    [40, 41, 42],
    [77, 66, 55, 44, 33],
    [90, 91, 92, 93, 94, 95, 96, 97, 98],
]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=True,
        initializer_range=0.3,
        eos_token_id=EOS,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ref_model(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture
def engine(model_path):
    eng = TransformersEngine(str(model_path), batch_wait_s=0.02)
    yield eng
    asyncio.run(eng.shutdown())


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int, stop=(EOS,)):
    """Step-by-step argmax with a full forward pass per token (no cache, no padding)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]  # (V,)
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
        if tok in stop:
            return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


def gather(engine, prompts, params):
    async def go():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return asyncio.run(go())


def one_at_a_time(engine, prompts, params):
    async def go():
        return [await engine.generate(p, params) for p in prompts]

    return asyncio.run(go())


def test_greedy_matches_uncached_reference(engine, ref_model):
    outs = one_at_a_time(engine, PROMPTS[:4], GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs, finish = reference_greedy(ref_model, prompt, GREEDY.max_new_tokens)
        assert out.token_ids == tokens, prompt
        assert out.finish_reason == finish
        assert out.logprobs == pytest.approx(logprobs, abs=1e-5)
    assert len({tuple(o.token_ids) for o in outs}) > 1, "degenerate model: every prompt gives the same output"


def test_concurrent_requests_are_batched_and_match_sequential(engine, ref_model, monkeypatch):
    sizes = []
    real = engine._generate_batch
    monkeypatch.setattr(engine, "_generate_batch", lambda reqs: sizes.append(len(reqs)) or real(reqs))
    batched = gather(engine, PROMPTS, GREEDY)
    assert max(sizes) > 1, f"requests were not batched: batch sizes {sizes}"
    sequential = one_at_a_time(engine, PROMPTS, GREEDY)
    for prompt, b, s in zip(PROMPTS, batched, sequential):
        assert b.token_ids == s.token_ids, prompt
        assert b.finish_reason == s.finish_reason
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-5)
        tokens, logprobs, _ = reference_greedy(ref_model, prompt, GREEDY.max_new_tokens)
        assert b.token_ids == tokens and b.logprobs == pytest.approx(logprobs, abs=1e-5)


def test_mixed_lengths_and_stop_ids_in_one_batch(engine, ref_model):
    full = one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0]
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_tok,)),
        SamplingParams(max_new_tokens=2, temperature=0.0),
        SamplingParams(max_new_tokens=12, temperature=0.0),
    ]

    async def go():
        return await asyncio.gather(*(engine.generate(PROMPTS[0], p) for p in params))

    stopped, short, long = asyncio.run(go())
    assert stopped.token_ids == full.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(full.logprobs[: first + 1], abs=1e-5)
    assert short.token_ids == full.token_ids[:2] and short.finish_reason == "length"
    assert long.token_ids == full.token_ids


def test_eos_comes_from_generation_config_or_argument(engine, model_path):
    assert engine.eos_token_ids == (EOS,)
    full = one_at_a_time(engine, [PROMPTS[5]], GREEDY)[0]
    eos = full.token_ids[2]
    custom = TransformersEngine(str(model_path), eos_token_ids=[eos, 127])
    assert custom.eos_token_ids == (eos, 127)
    out = one_at_a_time(custom, [PROMPTS[5]], GREEDY)[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(engine):
    def sample(seed, prompt=PROMPTS[2]):
        params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed)
        return one_at_a_time(engine, [prompt], params)[0].token_ids

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


def test_seeded_tokens_do_not_depend_on_batch_neighbours(engine):
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=100 + i) for i in range(8)]
    alone = asyncio.run(_each_alone(engine, PROMPTS, params))

    async def together():
        return await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(PROMPTS, params)))

    batched = asyncio.run(together())
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]


async def _each_alone(engine, prompts, params):
    return [await engine.generate(p, sp) for p, sp in zip(prompts, params)]


def test_sampling_logprobs_are_raw_and_top_p_tiny_is_greedy(engine, ref_model):
    hot = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=1e-6, seed=3)
    out = one_at_a_time(engine, [PROMPTS[4]], hot)[0]
    tokens, logprobs, _ = reference_greedy(ref_model, PROMPTS[4], 10)
    assert out.token_ids == tokens  # top_p -> 0 keeps only the argmax token
    assert out.logprobs == pytest.approx(logprobs, abs=1e-5)  # temperature does not change logprobs


def test_seed_none_uses_the_engine_generator(model_path):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    first = one_at_a_time(TransformersEngine(str(model_path), seed=5), [PROMPTS[1]] * 2, params)
    again = one_at_a_time(TransformersEngine(str(model_path), seed=5), [PROMPTS[1]] * 2, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids != first[1].token_ids


def test_score_matches_generate_logprobs(engine):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    outs = gather(engine, PROMPTS[:3], params)

    async def go():
        return await asyncio.gather(*(engine.score(p, o.token_ids) for p, o in zip(PROMPTS, outs)))

    scores = asyncio.run(go())
    for out, score in zip(outs, scores):
        assert len(score) == len(out.token_ids)
        assert score == pytest.approx(out.logprobs, abs=1e-5)
    assert asyncio.run(engine.score(PROMPTS[0], [])) == []


def test_load_weights_changes_outputs_and_checks_names(engine):
    before = one_at_a_time(engine, PROMPTS[:3], GREEDY)
    embed = engine.model.get_input_embeddings().weight
    new_embed = torch.randn_like(embed) * 0.3
    assert engine.load_weights([("model.embed_tokens.weight", new_embed)]) == 1
    # tied: the output projection is the same tensor
    assert torch.equal(engine.model.get_output_embeddings().weight, new_embed)
    assert torch.equal(dict(engine.named_weights())["lm_head.weight"], new_embed)
    after = one_at_a_time(engine, PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    # the alias name loads the same tensor
    assert engine.load_weights([("lm_head.weight", embed.clone().fill_(0.5))]) == 1
    assert float(engine.model.get_input_embeddings().weight[3, 4]) == 0.5

    with pytest.raises(KeyError, match="model.not_a_weight"):
        engine.load_weights([("model.not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.load_weights([("model.norm.weight", torch.zeros(31))])


def test_sleep_level_2_refuses_until_every_weight_is_loaded_and_woken(engine):
    expected = one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids
    weights = [(n, t.clone()) for n, t in engine.named_weights()]

    asyncio.run(engine.sleep(level=2))
    with pytest.raises(RuntimeError, match=r"weights dropped by sleep\(level=2\)"):
        one_at_a_time(engine, [PROMPTS[0]], GREEDY)
    asyncio.run(engine.wake(["weights"]))
    assert engine.load_weights(weights[:5]) == 5  # a partial push
    asyncio.run(engine.wake(["kv_cache"]))
    with pytest.raises(RuntimeError, match="weights dropped"):
        one_at_a_time(engine, [PROMPTS[0]], GREEDY)
    with pytest.raises(RuntimeError, match="weights dropped"):
        asyncio.run(engine.score(PROMPTS[0], [1, 2]))

    assert engine.load_weights(weights) == len(weights)
    asyncio.run(engine.reset_prefix_cache())
    assert one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids == expected


def test_sleep_level_1_needs_wake(engine):
    asyncio.run(engine.sleep(level=1))
    with pytest.raises(RuntimeError, match="asleep"):
        one_at_a_time(engine, [PROMPTS[0]], GREEDY)
    asyncio.run(engine.wake())
    assert one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="sleep level"):
        asyncio.run(engine.sleep(level=3))
    with pytest.raises(ValueError, match="wake tags"):
        asyncio.run(engine.wake(["gpu"]))


def test_too_long_and_out_of_vocab_requests_fail_alone(engine):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        one_at_a_time(engine, [[5] * 60], SamplingParams(max_new_tokens=5))

    async def go():
        return await asyncio.gather(
            engine.generate([5, 128], GREEDY), engine.generate(PROMPTS[0], GREEDY), return_exceptions=True
        )

    bad, good = asyncio.run(go())
    assert isinstance(bad, ValueError) and "outside the vocabulary" in str(bad)
    assert good.token_ids == one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="empty"):
        one_at_a_time(engine, [[]], GREEDY)


@pytest.mark.parametrize("fast_decode", [False, True], ids=["transformers-loop", "fast-loop"])
def test_failure_inside_a_batch_fails_only_that_batch(model_path, fast_decode):
    engine = TransformersEngine(str(model_path), max_batch_size=2, batch_wait_s=0.05, fast_decode=fast_decode)
    if fast_decode:  # rlsys/engines/cpu_decode.py runs the model from its weights: fail its prefill instead
        from rlsys.engines.cpu_decode import FastDecoder

        owner = engine._fast_decoder = FastDecoder(engine.model)
        name = "prefill"
    else:
        owner, name = engine.model, "forward"
    real_forward = getattr(owner, name)
    calls = {"n": 0}

    def flaky_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    setattr(owner, name, flaky_forward)
    results = asyncio.run(_gather_exceptions(engine, PROMPTS[:4]))
    assert [isinstance(r, RuntimeError) and "injected" in str(r) for r in results] == [True, True, False, False]
    assert one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids  # still serving
    asyncio.run(engine.shutdown())


async def _gather_exceptions(engine, prompts):
    return await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts), return_exceptions=True)


def test_event_loop_stays_responsive_during_a_batch(engine):
    from rlsys.engines.cpu_decode import FastDecoder

    # both loops' forward passes: transformers' and rlsys/engines/cpu_decode.py's (the default here)
    owner = engine._fast_decoder = FastDecoder(engine.model)
    for target, name in ((engine.model, "forward"), (owner, "prefill"), (owner, "decode_step")):
        real = getattr(target, name)

        def slow_forward(*args, _real=real, **kwargs):
            time.sleep(0.05)  # releases the GIL like a real forward pass
            return _real(*args, **kwargs)

        setattr(target, name, slow_forward)

    async def go():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=0.0))
        stop.set()
        await tick
        return gaps

    gaps = asyncio.run(go())
    # a loop blocked for the batch would show one gap >= 11 forwards * 0.05 s
    assert len(gaps) >= 10 and max(gaps) < 0.3, f"event loop stalled: {len(gaps)} ticks, max gap {max(gaps):.3f}s"


def test_shutdown_stops_serving(model_path):
    engine = TransformersEngine(str(model_path))

    async def go():
        await engine.generate(PROMPTS[0], GREEDY)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate(PROMPTS[0], GREEDY)

    asyncio.run(go())


def test_make_engine_is_lazy(model_path):
    assert isinstance(make_engine("transformers", str(model_path)), TransformersEngine)
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_engine("tgi", str(model_path))
    code = (
        "import sys, rlsys.engines; "
        "assert 'vllm' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- shared prefill, the batched sampler and the batch wait

GROUPS = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[7]]  # 4 prompts x 4 samples, as a rollout sends them
HOT = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=200 + i) for i in range(16)]


def _prefill_rows(engine, monkeypatch) -> list[int]:
    """Rows of each prefill forward, in either loop (the transformers one, or rlsys/engines/cpu_decode.py's)."""
    from rlsys.engines.cpu_decode import FastDecoder

    rows = []
    real = engine._forward

    def forward(input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1:
            rows.append(input_ids.shape[0])
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", forward)
    fast = engine._fast_decoder = FastDecoder(engine.model)
    real_prefill = fast.prefill

    def prefill(input_ids, pad_mask, start=0, prefix=None):
        rows.append(input_ids.shape[0])  # GROUPS share no prefix: one call, the distinct prompts
        return real_prefill(input_ids, pad_mask, start, prefix)

    monkeypatch.setattr(fast, "prefill", prefill)
    return rows


async def _group_requests(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(prompts[i // 4], p) for i, p in enumerate(params)))


def test_shared_prefill_gives_the_unshared_samples(model_path, monkeypatch):
    shared = TransformersEngine(str(model_path), batch_wait_s=0.02)
    plain = TransformersEngine(str(model_path), batch_wait_s=0.02, share_prefill=False)
    shared_rows, plain_rows = _prefill_rows(shared, monkeypatch), _prefill_rows(plain, monkeypatch)
    a = asyncio.run(_group_requests(shared, GROUPS, HOT))
    b = asyncio.run(_group_requests(plain, GROUPS, HOT))
    assert shared_rows == [4] and plain_rows == [16], "the shared engine must prefill each distinct prompt once"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"request {i}: shared prefill sampled other tokens"
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5), f"request {i}"
        assert x.finish_reason == y.finish_reason
    for g in range(4):  # the samples of a group are independent draws, not copies of one
        assert len({tuple(o.token_ids) for o in a[4 * g : 4 * g + 4]}) > 1, f"group {g}: all samples equal"


def test_shared_prefill_rows_stay_independent_as_rows_finish(engine, ref_model):
    # greedy copies of one prompt with different lengths: the cache rows are copies, so dropping a
    # finished row must not disturb the others, and each must match the uncached reference
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (3, 12, 7, 12)]

    async def go():
        return await asyncio.gather(*(engine.generate(PROMPTS[6], p) for p in params))

    tokens, logprobs, _ = reference_greedy(ref_model, PROMPTS[6], 12)
    for p, out in zip(params, asyncio.run(go())):
        n = len(out.token_ids)
        assert out.token_ids == tokens[:n] and n == min(p.max_new_tokens, len(tokens))
        assert out.logprobs == pytest.approx(logprobs[:n], abs=1e-5)


def test_batched_sampler_matches_one_row_at_a_time():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3  # (b, V)
    logits[4, 7] = 30.0  # one row whose top-p mass is a single token
    params = [SamplingParams(max_new_tokens=1, temperature=t, top_p=p, seed=0)
              for t, p in ((1.0, 0.9), (1.0, 1.0), (0.0, 1.0), (1.3, 0.9), (1.0, 0.5), (1.0, 0.9))]
    for draw in range(20):
        gens = [torch.Generator().manual_seed(100 * draw + r) for r in range(6)]
        together = sample_rows(logits, params, gens).tolist()
        gens = [torch.Generator().manual_seed(100 * draw + r) for r in range(6)]
        alone = [int(sample_rows(logits[r : r + 1], [params[r]], [gens[r]])) for r in range(6)]
        assert together == alone, f"draw {draw}"
        assert together[2] == int(logits[2].argmax()) and together[4] == 7
    # each sampled row consumed exactly one uniform from its own generator, the greedy row none
    gens = [torch.Generator().manual_seed(r) for r in range(6)]
    sample_rows(logits, params, gens)
    for r, g in enumerate(gens):
        ref = torch.Generator().manual_seed(r)
        if params[r].temperature > 0:
            torch.rand((), generator=ref)
        assert float(torch.rand((), generator=g)) == float(torch.rand((), generator=ref)), f"row {r}"


def test_staggered_requests_share_one_batch_until_a_quiet_gap(model_path, monkeypatch):
    engine = TransformersEngine(str(model_path), batch_wait_s=0.1, batch_wait_max_s=2.0)
    sizes = []
    real = engine._generate_batch
    monkeypatch.setattr(engine, "_generate_batch", lambda reqs: sizes.append(len(reqs)) or real(reqs))

    async def staggered(gap_s):
        async def one(i):
            await asyncio.sleep(i * gap_s)
            return await engine.generate(PROMPTS[i], GREEDY)

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    asyncio.run(staggered(0.02))  # 8 requests over 0.14 s, gaps of 20 ms < the 100 ms quiet gap
    assert sizes == [8], f"staggered requests were split into batches {sizes}"
    sizes.clear()
    asyncio.run(staggered(0.3))  # gaps longer than the quiet gap: each request goes alone
    assert sizes == [1] * 8, sizes
    asyncio.run(engine.shutdown())


def test_batch_wait_is_capped(model_path, monkeypatch):
    engine = TransformersEngine(str(model_path), batch_wait_s=0.1, batch_wait_max_s=0.15)
    sizes = []
    real = engine._generate_batch
    monkeypatch.setattr(engine, "_generate_batch", lambda reqs: sizes.append(len(reqs)) or real(reqs))

    async def trickle():
        async def one(i):
            await asyncio.sleep(i * 0.05)
            return await engine.generate(PROMPTS[i], GREEDY)

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    asyncio.run(trickle())  # a new request every 50 ms for 0.35 s: never quiet for 100 ms
    assert sizes[0] < 8 and sum(sizes) == 8, f"the first batch waited past batch_wait_max_s: {sizes}"
    with pytest.raises(ValueError, match="batch_wait_max_s"):
        TransformersEngine(str(model_path), batch_wait_s=0.2, batch_wait_max_s=0.1)
    asyncio.run(engine.shutdown())


def test_an_announced_wave_is_one_batch_whatever_its_gaps_and_a_short_one_is_given_up_on(model_path, monkeypatch):
    # the rollout phase says how many requests it sends (Engine.expect): gaps longer than the quiet gap no longer
    # split them (on 2 cores the late ones are late because the batch before them holds the CPU)
    engine = TransformersEngine(str(model_path), batch_wait_s=0.02, batch_wait_max_s=0.05, expect_wait_max_s=5.0)
    sizes = []
    real = engine._generate_batch
    monkeypatch.setattr(engine, "_generate_batch", lambda reqs: sizes.append(len(reqs)) or real(reqs))

    async def staggered(n, gap_s, expect=None):
        if expect is not None:
            engine.expect(expect)

        async def one(i):
            await asyncio.sleep(i * gap_s)
            return await engine.generate(PROMPTS[i], GREEDY)

        return await asyncio.gather(*(one(i) for i in range(n)))

    # gaps of 300 ms (longer than a batch of one takes on a loaded box), a 20 ms quiet gap, no announcement
    plain = asyncio.run(staggered(8, 0.3))
    assert sizes == [1] * 8, sizes
    sizes.clear()
    waved = asyncio.run(staggered(8, 0.3, expect=8))
    assert sizes == [8], f"the announced wave was split into {sizes}"
    assert [o.token_ids for o in waved] == [o.token_ids for o in plain]  # batching changes no greedy token
    assert engine._expected == 0
    sizes.clear()
    # 3 of an announced 8 come: the batch starts expect_wait_max_s after the first with those 3, and the rest of
    # the wave is given up on, so later requests batch by the quiet gap again
    engine.expect_wait_max_s = 0.3
    asyncio.run(staggered(3, 0.01, expect=8))
    assert sizes == [3] and engine._expected == 0, (sizes, engine._expected)
    sizes.clear()
    asyncio.run(staggered(2, 0.2))
    assert sizes == [1, 1], sizes
    with pytest.raises(ValueError, match="n must be >= 0"):
        engine.expect(-1)
    asyncio.run(engine.shutdown())


def test_a_score_does_not_wait_for_an_announced_wave(model_path):
    """The canary's score runs at once even while a wave of generate requests is announced and has not come (an SFT
    step announces none now, but an agent may send fewer requests than announced): it used to wait
    `expect_wait_max_s` for the wave, 1 s of each SFT step of the CPU recipe."""
    engine = TransformersEngine(str(model_path), batch_wait_s=0.02, batch_wait_max_s=0.05, expect_wait_max_s=60.0)
    prompt, continuation = PROMPTS[0][:6], PROMPTS[0][6:10]

    async def scored():
        engine.expect(8)
        return await asyncio.wait_for(engine.score(prompt, continuation), timeout=20)  # far below the 60 s wait

    lp = asyncio.run(scored())
    assert len(lp) == len(continuation) and all(v <= 0.0 for v in lp)
    assert engine._expected == 8  # the wave is still announced for the generate requests that come
    asyncio.run(engine.shutdown())


def test_growing_cache_keeps_what_dynamic_cache_keeps(model_path):
    from transformers import AutoConfig, DynamicCache

    from rlsys.engines.hf_loop import growing_cache

    config = AutoConfig.from_pretrained(model_path)
    grow, plain = growing_cache(config, capacity=6), DynamicCache(config=config)
    assert type(grow.layers[0]).__name__ == "GrowingLayer"
    torch.manual_seed(0)

    def step(length, rows):
        k, v = torch.randn(rows, 2, length, 8), torch.randn(rows, 2, length, 8)  # (B, H, T, D)
        return grow.update(k, v, 0), plain.update(k, v, 0)

    step(4, 5)  # prefill of 4 positions, room for 6
    step(1, 5)
    rows = torch.tensor([0, 0, 4, 3, 1])  # repeated (shared prefill), reordered and dropped rows, same count
    grow.batch_select_indices(rows)
    plain.batch_select_indices(rows)
    for _ in range(4):  # past the capacity: the buffer must grow
        (gk, gv), (pk, pv) = step(1, 5)
        assert torch.equal(gk, pk) and torch.equal(gv, pv)
    assert grow.get_seq_length() == plain.get_seq_length() == 9


def test_num_threads_applies_to_the_worker_thread(model_path):
    before = torch.get_num_threads()
    engine = TransformersEngine(str(model_path), num_threads=1)
    assert engine._executor.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before  # the caller's threads are left alone
    assert one_at_a_time(engine, [PROMPTS[0]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="num_threads"):
        TransformersEngine(str(model_path), num_threads=0)


# ---- OpenAI's sampling options: penalties, logit bias, stop strings, tiny temperatures (issue #30) -----------


@torch.no_grad()
def reference_adjusted_greedy(model, prompt, max_new_tokens, frequency=0.0, presence=0.0, bias=()):
    """Argmax of the logits less OpenAI's penalties (over generated tokens) plus the bias; raw logprobs."""
    ids, tokens, logprobs = list(prompt), [], []
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]  # (V,)
        adjusted = logits - frequency * counts - presence * (counts > 0).float()
        for tok, b in bias:
            adjusted[tok] += b
        tok = int(torch.argmax(adjusted))
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        ids.append(tok)
        counts[tok] += 1
        if tok == EOS:
            break
    return tokens, logprobs


def test_penalties_and_logit_bias_match_the_reference_per_row(engine, ref_model):
    plain = GREEDY
    penalised = SamplingParams(max_new_tokens=12, temperature=0.0, frequency_penalty=-2.0, presence_penalty=0.5)
    forced = SamplingParams(max_new_tokens=12, temperature=0.0, logit_bias=((EOS, -100.0), (42, 100.0)))
    prompt = PROMPTS[0]
    outs = asyncio.run(_generate_all(engine, [(prompt, plain), (prompt, penalised), (prompt, forced)]))
    base, _, _ = reference_greedy(ref_model, prompt, 12)
    assert outs[0].token_ids == base
    tokens, logprobs = reference_adjusted_greedy(ref_model, prompt, 12, frequency=-2.0, presence=0.5)
    assert outs[1].token_ids == tokens and outs[1].logprobs == pytest.approx(logprobs, abs=1e-5)
    assert tokens != base, "the penalties should change this prompt's greedy tokens"
    assert outs[2].token_ids == [42] * 12, "a +100 bias makes the token certain, -100 on eos keeps it going"


async def _generate_all(engine, requests):
    return await asyncio.gather(*(engine.generate(p, params) for p, params in requests))


def test_a_tiny_positive_temperature_samples_greedily(engine, ref_model):
    outs = asyncio.run(_generate_all(engine, [(PROMPTS[4], SamplingParams(max_new_tokens=10, temperature=t, seed=1))
                                              for t in (1e-38, 1e-6)]))
    tokens, logprobs, _ = reference_greedy(ref_model, PROMPTS[4], 10)
    for out in outs:
        assert out.token_ids == tokens and out.logprobs == pytest.approx(logprobs, abs=1e-5)


def test_stop_strings_end_with_the_token_that_completes_them():
    from transformers import AutoTokenizer

    from rlsys.models.tiny import ensure_tiny_model

    path = str(ensure_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = TransformersEngine(path, batch_wait_s=0.02)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Your move."}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    free = SamplingParams(max_new_tokens=20, temperature=0.0)
    try:
        (unstopped,) = asyncio.run(_generate_all(engine, [(prompt, free)]))
        ids = unstopped.token_ids
        stop = tokenizer.decode(ids[:12])[len(tokenizer.decode(ids[:6])):][:3]  # starts within the 7th token
        assert stop
        stopped, other = asyncio.run(_generate_all(engine, [
            (prompt, SamplingParams(max_new_tokens=20, temperature=0.0, stop=(stop, "never appears"))),
            (prompt, free)]))  # a neighbour in the batch without stop strings runs on
    finally:
        asyncio.run(engine.shutdown())
    got = stopped.token_ids
    assert got == ids[:len(got)] and len(got) < len(ids) and stopped.finish_reason == "stop"
    assert stop in tokenizer.decode(got) and stop not in tokenizer.decode(got[:-1])
    assert stopped.logprobs == pytest.approx(unstopped.logprobs[:len(got)], abs=1e-5)
    assert other.token_ids == ids
