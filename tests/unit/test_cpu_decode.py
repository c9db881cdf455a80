"""The CPU engine's decode loop (rlsys/engines/cpu_decode.py) against its transformers loop, request for request.

Both are ``TransformersEngine``s on the same model; ``fast_decode=False`` is the transformers loop the engine used
before (and still uses for models the new loop does not cover). Same seeds and sampling params -> the same token ids,
finish reasons, and logprobs to 1e-4 (they agree to ~1e-6: the new loop's arithmetic is the same per row, in another
order). A token can only differ where a uniform lands within ~1e-6 of a CDF boundary; with top-p the CDF is in sorted
order, and a near-uniform distribution has near-ties that such a difference reorders (about 1 token in 5,000 on the
random-init tiny model), so the top-p cases run on a model with peaked distributions (a wide init), where the seeds
below never meet one, and the tiny model's case samples the full vocabulary.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsys.engines.base import SamplingParams
from rlsys.engines.transformers_engine import TransformersEngine

EOS = 1
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a "system prompt" every prompt starts with
PROMPTS = [SHARED + [20, 21, 22], SHARED + [30], SHARED + [40, 41, 42, 43, 44, 45, 46], SHARED + [50, 51]]
SEEDS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, initializer_range=0.3, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("peaked_qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def _engines(path: str, **kwargs) -> dict[str, TransformersEngine]:
    return {name: TransformersEngine(path, max_batch_size=256, batch_wait_s=0.05, fast_decode=fast, **kwargs)
            for name, fast in (("transformers", False), ("fast", True))}


def _generate_both(engines, requests: list[tuple[list[int], SamplingParams]]):
    """Each engine's outputs for ``requests``, sent at once (one batch each)."""
    async def run(engine):
        return await asyncio.gather(*[engine.generate(p, params) for p, params in requests])

    async def both():
        outs = {name: await run(engine) for name, engine in engines.items()}
        for engine in engines.values():
            await engine.shutdown()
        return outs

    outs = asyncio.run(both())
    assert engines["fast"].fast_decode and not engines["transformers"].fast_decode
    return outs["transformers"], outs["fast"]


def _assert_same(old, new, requests) -> None:
    for i, (a, b) in enumerate(zip(old, new)):
        assert b.token_ids == a.token_ids, f"request {i} ({requests[i][1]}): token ids differ"
        assert b.finish_reason == a.finish_reason, f"request {i}: finish reason differs"
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), f"request {i}: logprobs differ"


def _requests(prompts, samples: int, seed: int, make_params) -> list[tuple[list[int], SamplingParams]]:
    return [(p, make_params(g, s, seed * 1000 + g * 100 + s)) for g, p in enumerate(prompts) for s in range(samples)]


SETTINGS = {
    "temperature-1": lambda g, s, seed: SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed),
    "top-p": lambda g, s, seed: SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=seed),
    "greedy": lambda g, s, seed: SamplingParams(max_new_tokens=16, temperature=0.0, seed=seed),
    # every request different: temperature, top-p, length, stop ids, penalties, logit bias; greedy among them
    "mixed": lambda g, s, seed: SamplingParams(
        max_new_tokens=(6, 16, 11)[s % 3], temperature=(1.0, 0.7, 0.0, 1.3)[(g + s) % 4],
        top_p=(1.0, 0.8, 0.95)[s % 3], seed=seed, stop_token_ids=(5,) if s % 2 else (),
        frequency_penalty=(0.0, 0.5, -0.3)[g % 3], presence_penalty=(0.0, 0.25)[s % 2],
        logit_bias=((5, 8.0), (9, -1.5)) if g % 2 else ()),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_same_tokens_and_logprobs_as_the_transformers_loop(peaked_model, setting):
    for seed in SEEDS:
        requests = _requests(PROMPTS + [[60, 61, 62, 63, 64]], 3, seed, SETTINGS[setting])
        old, new = _generate_both(_engines(peaked_model), requests)
        _assert_same(old, new, requests)
        if setting == "mixed":  # stop id 5 with a logit bias: some requests end early, so finished rows are tested
            assert any(o.finish_reason == "stop" for o in new), "no request stopped early: the case tests less"


def test_uneven_groups_and_unshared_prefill(peaked_model):
    """One prompt with 8 samples beside single ones (the layout gives each request its own row), prompts without a
    common prefix, and ``share_prefill=False``."""
    make = SETTINGS["top-p"]
    uneven = [(PROMPTS[0], make(0, s, 100 + s)) for s in range(8)] + [(p, make(g, 0, 200 + g))
                                                                        for g, p in enumerate(PROMPTS[1:])]
    no_common = [([3 + g, 4, 5 + g], make(g, s, 300 + 10 * g + s)) for g in range(3) for s in range(2)]
    for requests in (uneven, no_common):
        old, new = _generate_both(_engines(peaked_model), requests)
        _assert_same(old, new, requests)
    requests = _requests(PROMPTS, 2, 7, make)
    old, new = _generate_both(_engines(peaked_model, share_prefill=False), requests)
    _assert_same(old, new, requests)


def test_load_weights_reaches_the_fast_loop(peaked_model):
    """The fast loop holds fused copies of the projections: a weight push must replace them."""
    engines = _engines(peaked_model)
    torch.manual_seed(1)
    pushed = [(name, torch.randn_like(t) * 0.3) for name, t in engines["transformers"].named_weights()]
    requests = _requests(PROMPTS, 2, 5, SETTINGS["top-p"])
    before = _generate_both(_engines(peaked_model), requests)[1]
    for engine in engines.values():
        engine.load_weights(pushed)
    old, new = _generate_both(engines, requests)
    _assert_same(old, new, requests)
    assert [o.token_ids for o in new] != [o.token_ids for o in before], "the pushed weights changed nothing"


def test_tiny_model_with_stop_strings(tiny_model_path):
    """The embedded tiny model (real tokenizer): stop strings, eos, the full-vocabulary sampler."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    system = "You play tic-tac-toe as X. Squares are numbered 1-9, left to right, top to bottom."
    prompts = [tok(f"{system}\n{board}\nYour move.").input_ids for board in ("X|2|3", "1|O|X\n4|5|6", "7")]
    for seed in SEEDS[:2]:
        requests = _requests(prompts, 4, seed, lambda g, s, seed: SamplingParams(
            max_new_tokens=20, temperature=1.0, seed=seed, stop=("e",) if s % 2 else ()))
        old, new = _generate_both(_engines(tiny_model_path), requests)
        _assert_same(old, new, requests)
        assert any(o.finish_reason == "stop" for o in new), "no stop string was hit: the case tests nothing"


def test_unsupported_models_use_the_transformers_loop(tmp_path):
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_sliding_window=True, sliding_window=8, max_window_layers=0)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    assert not TransformersEngine(str(tmp_path)).fast_decode
    with pytest.raises(ValueError, match="sliding-window"):
        TransformersEngine(str(tmp_path), fast_decode=True)


def test_sorted_values_and_ids_match_a_stable_sort():
    """The top-p sampler's numpy sort of values + id lookup: ``torch.sort(stable=True)``'s values and ids, ties
    included (equal logits, and probabilities that underflow to 0)."""
    from rlsys.engines.cpu_decode import _ids_at, _sorted_descending

    torch.manual_seed(0)
    for trial in range(60):
        logits = torch.randn(16, 50) * (0.01, 3.0, 60.0)[trial % 3]
        if trial % 2:
            logits[:, ::3] = logits[:, :1]  # a third of each row tied
        probs = torch.softmax(logits, dim=-1)
        reference = probs.sort(dim=-1, descending=True, stable=True)
        sorted_probs = _sorted_descending(probs)
        assert torch.equal(sorted_probs, reference.values), f"trial {trial}: sorted values differ"
        pos = torch.randint(0, 50, (16,))
        assert torch.equal(_ids_at(probs, sorted_probs, pos), reference.indices.gather(1, pos[:, None]).squeeze(1)), \
            f"trial {trial}: ids differ"
