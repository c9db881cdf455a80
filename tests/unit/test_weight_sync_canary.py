"""WeightSync.check_canary: how often it scores, and that a stale engine fails the step.

Ray is replaced by plain calls here (the method's own logic is under test; tests/loop runs it through Ray)."""
from __future__ import annotations

import pytest

import jobs.cluster as cluster


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


def _sync(engine_logprobs: list[float], every: int) -> tuple[cluster.WeightSync, _Actor, _Actor]:
    learner, engine = _Actor([-1.0, -2.0]), _Actor(engine_logprobs)
    sync = cluster.WeightSync(learners=[learner], engines=[engine], sources=[0], transports=["object_store"],
                              bucket_bytes=1 << 20, expected_count=1, canary_prompt=[1, 2],
                              canary_continuation=[3, 4], canary_tol=0.01, canary_every=every)
    return sync, learner, engine


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(cluster.ray, "get", lambda refs: refs)


def test_canary_every_n_scores_the_start_and_every_nth_push():
    sync, learner, engine = _sync([-1.0, -2.0], every=3)
    results = [sync.check_canary() for _ in range(7)]  # the start, then pushes 1..6
    assert [bool(r) for r in results] == [True, False, False, True, False, False, True]
    assert len(learner.calls) == len(engine.calls) == 3
    assert results[0] == {"sync/canary_logp_diff": 0.0}


def test_a_stale_engine_fails_on_a_checked_push_only():
    sync, _, engine = _sync([-1.0, -2.0], every=2)
    sync.check_canary()  # start: healthy
    engine.logprobs = [-1.5, -2.5]  # a push went wrong
    assert sync.check_canary() == {}  # push 1: not checked with every=2
    with pytest.raises(RuntimeError, match="stale-weights canary: engine 0 .* 0.5"):
        sync.check_canary()  # push 2
