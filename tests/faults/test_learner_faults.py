"""Learner and weight-sync faults: a non-finite loss skips the optimizer step; an engine with wrong or
dropped weights fails the canary loudly instead of rolling out with stale weights."""
from __future__ import annotations

import pytest
import torch

from rlsys.types import Segment, Trajectory
from tests.conftest import job_config

pytestmark = pytest.mark.timeout(300)


def _trajectories() -> list[Trajectory]:
    out = []
    for sample, reward in enumerate([1.0, 0.0, 0.5, -1.0]):
        ids = [5, 6, 7, 8 + sample, 9, 10]
        seg = Segment(input_ids=ids, loss_mask=[0, 0, 0, 1, 1, 1], rollout_logprobs=[0, 0, 0, -1.0, -2.0, -0.5])
        out.append(Trajectory(item_id="b", group=0, sample=sample, segments=[seg], reward=reward, num_turns=1))
    return out


def test_non_finite_loss_skips_the_optimizer_step(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    learner = make_learner(job_config(tmp_path), tiny_model_path)
    with torch.no_grad():
        learner.model.model.norm.weight.fill_(float("inf"))  # every logit becomes NaN
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    stats = learner.train(_trajectories())
    assert stats["train/skipped_steps"] == 1.0
    assert not torch.isfinite(torch.tensor(stats["train/grad_norm"]))
    assert learner.optimizer_steps == 0
    for name, p in learner.model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed although the step was skipped"

    healthy = make_learner(job_config(tmp_path), tiny_model_path)
    assert healthy.train(_trajectories())["train/skipped_steps"] == 0.0 and healthy.optimizer_steps == 1


def test_canary_catches_wrong_and_missing_engine_weights(ray_local, tmp_path, tiny_model_path):
    import ray

    from jobs.job import Job
    from rlsys.models.tiny import create_tiny_model
    from rlsys.weights.buckets import BucketPacker
    from rlsys.weights.transport import ObjectStoreTransport

    job = Job.start(job_config(tmp_path))
    try:
        job.weights.check_canary()  # healthy to begin with
        other, _ = create_tiny_model(seed=123)  # same shapes, other weights: a corrupted push
        named = list(other.named_parameters())
        payload = ObjectStoreTransport().export(BucketPacker.for_tensors(named).pack(named))
        assert ray.get(job.rollouts[0].load_weights.remote(payload)) == len(named)
        with pytest.raises(RuntimeError, match="stale-weights canary: engine 0 logprobs differ"):
            job.weights.check_canary()

        job.weights.push()  # a real push repairs it
        job.weights.check_canary()

        job.engines.sleep(level=2)  # weights dropped ...
        job.engines.wake()          # ... and the push skipped
        with pytest.raises(ray.exceptions.RayTaskError, match="weights dropped"):
            job.weights.check_canary()
    finally:
        job.shutdown()


class _EngineThatSkipsLoads:
    """A rollout actor whose `load_weights` reports the full count without loading: a push that never landed."""

    def __init__(self, handle, count: int) -> None:
        self._handle, self._count = handle, count

    @property
    def load_weights(self):
        import ray

        count = self._count
        return type("Remote", (), {"remote": staticmethod(lambda *payloads: ray.put(count))})

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_the_fingerprint_fails_a_skipped_or_corrupted_push_on_its_step_between_canaries(ray_local, tmp_path,
                                                                                          tiny_model_path):
    import ray

    from jobs.job import Job
    from rlsys.models.tiny import create_tiny_model
    from rlsys.weights.buckets import BucketPacker
    from rlsys.weights.transport import ObjectStoreTransport

    job = Job.start(job_config(tmp_path, "sync.canary_every=10"))  # the canary runs at the start only
    sync = job.weights
    try:
        ray.get(sync.learner.train.remote(_trajectories()))
        sync.push()
        assert sync.check_canary() == {"sync/fingerprinted": 1.0}  # push 1 landed: bits only, no canary due

        ray.get(sync.learner.train.remote(_trajectories()))  # the learner moves on ...
        engines, sync.engines = sync.engines, [_EngineThatSkipsLoads(e, sync.expected_count) for e in sync.engines]
        try:
            sync.push()  # ... and the engine answers the push without loading it
        finally:
            sync.engines = engines
        with pytest.raises(RuntimeError, match=r"weight fingerprint: engine 0 holds \d+ of the \d+ pushed tensors"):
            sync.check_canary()

        sync.push()  # a real push repairs it
        assert sync.check_canary()["sync/fingerprinted"] == 1.0
        other, _ = create_tiny_model(seed=123)  # one layer overwritten with other weights: a corrupted push
        named = [(n, p) for n, p in other.named_parameters() if ".layers.0." in n]
        ray.get(job.rollouts[0].load_weights.remote(
            ObjectStoreTransport().export(BucketPacker.for_tensors(named).pack(named))))
        with pytest.raises(RuntimeError, match=rf"holds {len(named)} of the \d+ pushed tensors .*layers\.0\."):
            sync.check_canary()
    finally:
        job.shutdown()


def test_a_trajectory_split_into_segments_counts_once(tmp_path, tiny_model_path):
    from tests.conftest import make_learner

    trajs = _trajectories()
    first = trajs[0].segments[0]
    trajs[0].segments.append(Segment(input_ids=first.input_ids + [11], loss_mask=[0] * 6 + [1],
                                     rollout_logprobs=[0.0] * 6 + [-1.0]))  # a turn that broke the prefix
    rows, _ = make_learner(job_config(tmp_path), tiny_model_path)._policy_rows(trajs)
    assert len(rows) == 5 and sum(r.weight for r in rows) == pytest.approx(4.0)
    split = [r for r in rows if r.group == 0 and r.weight == 0.5]
    assert len(split) == 2 and split[0].advantage == split[1].advantage
    whole = [r.advantage for r in rows if r.weight == 1.0]
    assert sum(r.advantage for r in split) + sum(whole) == pytest.approx(0.0, abs=1e-5)  # group mean 0
