"""WeightSync.check_canary: how often it scores, and that a stale engine fails the step (by its fingerprint after
every push, by the logprob canary on the pushes it checks).

Ray is replaced by plain calls here (the method's own logic is under test; tests/loop runs it through Ray)."""
from __future__ import annotations

import pytest

import jobs.weight_sync as weight_sync


class _Method:
    def __init__(self, fn, calls: list) -> None:
        self.fn, self.calls = fn, calls

    def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class _Actor:
    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs
        self.calls: list = []
        self.score = _Method(lambda prompt, continuation: list(self.logprobs), self.calls)
        self.sums: dict[str, int] | None = {"w": 7, "b": 3}  # weights_fingerprint's answer
        self.fingerprint_calls: list = []
        self.weights_fingerprint = _Method(lambda: self.sums, self.fingerprint_calls)


def _sync(engine_logprobs: list[float], every: int) -> tuple[weight_sync.WeightSync, _Actor, _Actor]:
    learner, engine = _Actor([-1.0, -2.0]), _Actor(engine_logprobs)
    sync = weight_sync.WeightSync(learners=[learner], engines=[engine], feeds=[[(0, 0)]], expected_count=1,
                                  canary_prompt=[1, 2], canary_continuation=[3, 4], canary_tol=0.01,
                                  canary_every=every)
    return sync, learner, engine


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(weight_sync.ray, "get", lambda refs: refs)


def test_canary_every_n_scores_the_start_and_every_nth_push():
    sync, learner, engine = _sync([-1.0, -2.0], every=3)
    results = [sync.check_canary() for _ in range(7)]  # the start, then pushes 1..6
    assert ["sync/canary_logp_diff" in r for r in results] == [True, False, False, True, False, False, True]
    assert len(learner.calls) == len(engine.calls) == 3
    # the fingerprint checked every push (not the start: nothing was pushed yet)
    assert len(engine.fingerprint_calls) == 6 and all(r["sync/fingerprinted"] == 1.0 for r in results[1:])
    assert results[0] == {"sync/canary_logp_diff": 0.0, "sync/canary_logp_mean": -1.5}
    assert results[3]["sync/canary_engine_shift"] == 0.0  # nothing moved the engine between checks


def test_the_canary_reports_how_far_each_push_moved_the_engines():
    sync, learner, engine = _sync([-1.0, -2.0], every=1)
    assert "sync/canary_engine_shift" not in sync.check_canary()  # the start: nothing to compare with
    learner.logprobs = engine.logprobs = [-1.25, -1.5]  # a push that landed
    moved = sync.check_canary()
    assert moved["sync/canary_engine_shift"] == moved["sync/canary_learner_shift"] == pytest.approx(0.375)
    assert moved["sync/canary_logp_diff"] == 0.0


def test_an_engine_that_stands_still_while_the_learner_moves_fails_within_the_tolerance():
    sync, learner, engine = _sync([-1.0, -2.0], every=1)
    sync.canary_tol = 0.15  # fp32 masters' tolerance: wider than this push's change
    sync.check_canary()
    learner.logprobs = [-1.05, -2.05]  # the learner moved 0.05; the engine kept its weights
    with pytest.raises(RuntimeError, match="engine 0 logprobs moved 0 since the last check while the learner's moved 0.05"):
        sync.check_canary()
    sync.canary_follow = False  # fp32 masters: bf16 pushes round small moves away, only the tolerance applies
    sync._canary_last = ([-1.0, -2.0], [[-1.0, -2.0]])
    assert sync.check_canary()["sync/canary_engine_shift"] == 0.0


def test_without_the_fingerprint_a_stale_engine_fails_on_a_checked_push_only():
    sync, _, engine = _sync([-1.0, -2.0], every=2)
    sync.fingerprint = False
    sync.check_canary()  # start: healthy
    engine.logprobs = [-1.5, -2.5]  # a push went wrong
    assert sync.check_canary() == {}  # push 1: not checked with every=2
    with pytest.raises(RuntimeError, match="stale-weights canary: engine 0 .* 0.5"):
        sync.check_canary()  # push 2


def test_the_fingerprint_fails_the_push_that_did_not_land_between_canaries():
    sync, learner, engine = _sync([-1.0, -2.0], every=10)
    sync.check_canary()  # start
    learner.sums = {"w": 8, "b": 3}  # the learner sent new weights; the engine kept its old "w"
    with pytest.raises(RuntimeError, match=r"weight fingerprint: engine 0 holds 1 of the 2 pushed tensors .*\['w'\]"):
        sync.check_canary()  # push 1: no canary due, the bits tell
    engine.sums = {"w": 8, "b": 3, "lm_head.weight": 5}  # a push that landed (and a tied copy the learner omits)
    assert sync.check_canary() == {"sync/fingerprinted": 1.0}
    engine.sums = {"b": 3}  # a tensor the engine no longer reports counts as lost
    with pytest.raises(RuntimeError, match=r"\['w'\]"):
        sync.check_canary()


def test_a_push_an_engine_cannot_fingerprint_gets_the_canary():
    sync, learner, engine = _sync([-1.0, -2.0], every=10)
    sync.check_canary()  # start
    engine.sums = None  # e.g. vLLM before its copy plan exists, or tensor parallel
    out = sync.check_canary()
    assert out["sync/fingerprinted"] == 0.0 and "sync/canary_logp_diff" in out
    engine.logprobs = [-1.5, -2.5]
    with pytest.raises(RuntimeError, match="stale-weights canary"):
        sync.check_canary()
    learner.sums = None  # nothing exported yet on the learner's side: the canary too
    engine.logprobs, engine.sums = [-1.0, -2.0], {"w": 7, "b": 3}
    assert "sync/canary_logp_diff" in sync.check_canary()


@pytest.mark.parametrize("dtype, fp32_master, gpu, expected", [
    ("auto", False, False, "FP32_CANARY_TOL"), ("auto", False, True, "BF16_CANARY_TOL"),
    ("auto", True, True, "AUTOCAST_CANARY_TOL"), ("bfloat16", True, False, "AUTOCAST_CANARY_TOL"),
    ("float32", True, True, "FP32_CANARY_TOL")])
def test_the_default_canary_tolerance_follows_the_jobs_numerics(dtype, fp32_master, gpu, expected):
    import jobs.placement as placement
    from rlsys.config import load_config

    cfg = load_config(overrides=[f"model.dtype={dtype}", f"learner.fp32_master={str(fp32_master).lower()}"])
    assert placement.canary_tolerance(cfg.model, cfg.learner, gpu=gpu) == getattr(placement, expected)
    # a healthy fp32-master job (0.025-0.085 measured) passes; a skipped push (~3.8) fails under every default
    assert placement.BF16_CANARY_TOL < 0.025 < 0.085 < placement.AUTOCAST_CANARY_TOL < 3.8 / 10
