"""The weight routes once planned (rlsys/weights/routes.py): which payloads each engine loads, the collective groups,
and `WeightSync.push` moving payloads along them without naming a transport (Ray replaced by plain calls)."""
from __future__ import annotations

import pytest
import torch

import jobs.weight_sync as weight_sync
from rlsys.weights.buckets import BucketPacker
from rlsys.weights.routes import EngineRoute, RoutePlan
from rlsys.weights.transport import make_transport


def _plan(*routes: EngineRoute, backend: str = "gloo") -> RoutePlan:
    return RoutePlan(routes=tuple(routes), collective_backend=backend)


def test_feeds_name_each_payload_by_rank_and_the_index_of_its_transport():
    plan = _plan(EngineRoute("cuda_ipc", 0, "same GPU"), EngineRoute("collective", 0, "other GPU"),
                 EngineRoute("cuda_ipc", 1, "tp", per_gpu=((1, "GPU-b"), (0, "GPU-a"))))
    assert plan.transports_of(0) == ["collective", "cuda_ipc"] and plan.transports_of(1) == ["cuda_ipc"]
    assert plan.feeds() == [[(0, 1)], [(0, 0)], [(1, 0), (0, 1)]]


def test_with_groups_gives_each_source_rank_one_group_and_its_engines_ranks_in_order():
    plan = _plan(EngineRoute("collective", 1, "x"), EngineRoute("object_store", 0, "y"),
                 EngineRoute("collective", 1, "z"), EngineRoute("collective", 0, "w"))
    assert plan.collective_sources() == [0, 1]
    grouped = plan.with_groups({0: ("10.0.0.1", 1234), 1: ("10.0.0.2", 5678)}, timeout_s=7.0)
    first, store, third, fourth = grouped.routes
    assert first.group is third.group and (first.group_rank, third.group_rank) == (1, 2)
    assert (first.group.name, first.group.host, first.group.port, first.group.world_size) == (
        "learner-1 -> rollout-0, rollout-2", "10.0.0.2", 5678, 3)
    assert first.group.timeout_s == 7.0 and first.group.backend == "gloo"
    assert store.group is None and fourth.group.world_size == 2 and fourth.group_rank == 1
    assert grouped.group_of(1) is first.group and grouped.group_of(0) is fourth.group
    assert make_transport("collective", third.group, third.group_rank).rank == 2


def test_object_store_payload_received_on_a_device_is_a_copy_there():
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64))]
    transport = make_transport("object_store")
    payload = transport.export(BucketPacker.for_tensors(named).pack(named))
    got = dict(transport.receive(payload, torch.device("cpu")))
    assert all(torch.equal(got[n], t) for n, t in named)


# ------------------------------------------------------------------ the push, with Ray replaced by plain calls
class _Method:
    def __init__(self, actor, name: str, fn) -> None:
        self.actor, self.name, self.fn, self.returns = actor, name, fn, 1

    def options(self, num_returns: int):
        method = _Method(self.actor, self.name, self.fn)
        method.returns = num_returns
        return method

    def remote(self, *args):
        self.actor.log.append((self.actor.label, self.name, args))
        out = self.fn(*args)
        if self.returns > 1:
            assert isinstance(out, tuple) and len(out) == self.returns
        return out


class _Learner:
    def __init__(self, label: str, log: list, payloads: tuple) -> None:
        self.label, self.log = label, log
        self.export_weights = _Method(self, "export", lambda: payloads if len(payloads) > 1 else payloads[0])
        self.send_weights = _Method(self, "send", lambda: None)
        self.ipc_collect = _Method(self, "collect", lambda: None)


class _Engine:
    def __init__(self, label: str, log: list, count: int = 3) -> None:
        self.label, self.log = label, log
        self.wake = _Method(self, "wake", lambda tags: None)
        self.load_weights = _Method(self, "load", lambda *payloads: count)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr(weight_sync.ray, "get", lambda refs: refs)


def _sync(learners, engines, feeds) -> weight_sync.WeightSync:
    return weight_sync.WeightSync(learners=learners, engines=engines, feeds=feeds, expected_count=3,
                                  canary_prompt=[1], canary_continuation=[2], canary_tol=0.01)


def test_a_push_exports_before_waking_and_gives_each_engine_its_ranks_payloads():
    log: list = []
    learners = [_Learner("L0", log, ("ipc0", "plan0")), _Learner("L1", log, ("ipc1",)), _Learner("L2", log, ("x",))]
    engines = [_Engine("E0", log), _Engine("E1", log), _Engine("E2", log)]
    sync = _sync(learners, engines, [[(0, 0)], [(0, 1)], [(1, 0), (0, 0)]])  # rank 2 feeds nobody
    assert sync.push() == {"sync/tensors": 3.0}
    calls = [(who, what) for who, what, _ in log]
    assert calls[:2] == [("L0", "export"), ("L1", "export")] and ("L2", "export") not in calls
    assert calls.index(("E0", "wake")) < calls.index(("L0", "send")) < calls.index(("E0", "load"))
    assert [args for who, what, args in log if what == "load"] == [("ipc0",), ("plan0",), ("ipc1", "ipc0")]
    assert calls[-2:] == [("L0", "collect"), ("L1", "collect")]


def test_a_push_that_loads_too_few_tensors_fails():
    log: list = []
    sync = _sync([_Learner("L0", log, ("p",))], [_Engine("E0", log, count=2)], [[(0, 0)]])
    with pytest.raises(RuntimeError, match="engine 0 loaded 2 tensors, the learner sent 3"):
        sync.push()
