"""World size 2 on a simulated 2-node cluster with fake GPUs (ray.cluster_utils.Cluster): actors land as
planned, the learner ranks train as one gloo process group, and after every push both learner ranks and
both engines hold the same weights, by the object store (`auto` on CPU) and by gloo broadcasts
(`sync.transport = "collective"`). On one CPU node: the collective transport through a whole job, and a broken
route failing with an error that names it instead of hanging."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import PLUGINS, REPO, job_config

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def two_nodes(_ray_session):
    ray = _ray_session
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 1, "object_store_memory": 200 << 20, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=200 << 20)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
    yield ray
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("transport", ["auto", "collective"])
def test_world_size_two_places_trains_and_keeps_weights_equal(two_nodes, tmp_path, transport):
    ray = two_nodes
    from jobs.job import Job

    cfg = job_config(tmp_path, "cluster.placement_strategy=SPREAD", "model.dtype=float32",
                     f"sync.transport={transport}", world_size="2",
                     agent_fn=str(PLUGINS / "recording_agent.py"), reward_fn_path=str(PLUGINS / "length_reward.py"))
    job = Job.start(cfg)
    try:
        # placement: rank r and engine r share a node; the two bundles are on different nodes (SPREAD);
        # each env worker runs on the node of the engine it calls
        learner_nodes = ray.get([rank.node_id.remote() for rank in job.learners])
        engine_nodes = [p["node_id"] for p in job.proxies]
        assert len(job.learners) == 2 and len(job.rollouts) == 2
        assert learner_nodes == engine_nodes and len(set(engine_nodes)) == 2
        worker_nodes = ray.get([w.node_id.remote() for w in job.env_workers])
        assert worker_nodes == [engine_nodes[i % 2] for i in range(len(job.env_workers))]
        # fake GPUs: no CUDA to share, so auto = the object store; collective = one gloo group per rank
        expected = "object_store" if transport == "auto" else "collective"
        assert {p["transport"] for p in job.proxies} == {expected}

        for step in range(2):
            refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step)
            job.engines.sleep(level=1)
            stats = job.train(refs, summaries)
            assert stats["train/skipped_steps"] == 0 and stats["train/optimizer_steps"] == step + 1
            assert stats["train/rank_weight_spread"] == 0.0 and "train/weights_digest" not in stats
            job.weights.push()
            job.engines.wake()
            job.weights.check_canary()
            ranks = ray.get([rank.named_weights.remote() for rank in job.learners])
            engines = ray.get([e.named_weights.remote() for e in job.rollouts])
            for name, tensor in ranks[0].items():
                assert torch.equal(ranks[1][name], tensor), f"step {step}: learner ranks differ on {name}"
                for i, weights in enumerate(engines):
                    assert torch.equal(weights[name], tensor), f"step {step}: engine {i} differs on {name}"
        # both ranks trained: every sequence went to exactly one rank
        trained = ray.get([rank.last_trained.remote() for rank in job.learners])
        assert all(trained) and not {tuple(s.input_ids) for s in trained[0]} & {tuple(s.input_ids) for s in trained[1]}
        if transport == "collective":  # a group per (rank, engine) pair: rank r feeds engine r
            assert [(route.group.name, route.group_rank) for route in job.weights.routes] == [
                ("learner-0 -> rollout-0", 1), ("learner-1 -> rollout-1", 1)]
    finally:
        job.shutdown()


@pytest.fixture
def two_gpus_one_node(_ray_session):
    ray = _ray_session
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, num_gpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
    yield ray
    ray.shutdown()


def test_tensor_parallel_layout_one_engine_over_two_gpus_fed_by_both_ranks(two_gpus_one_node, tmp_path):
    """tp_size 2 on 2 fake GPUs: one rollout actor that holds no GPU itself (vLLM's Ray workers would take the
    bundles' shares), two learner ranks on the two GPUs; after a step both ranks and the engine hold the same
    weights. On CPU the engine is the transformers one (no Ray workers), so rank 0 feeds it by the object store."""
    ray = two_gpus_one_node
    from jobs.job import Job
    from rlsys.errors import UserInputError

    with pytest.raises(UserInputError, match="SPREAD.*one node"):
        Job.start(job_config(tmp_path, "cluster.placement_strategy=SPREAD", world_size="2", tp_size="2"))
    with pytest.raises(UserInputError, match="learner.reference_actor: CPU jobs only"):  # before any actor starts
        Job.start(job_config(tmp_path, "algo.kl_coef=0.1", "learner.reference_actor=true", world_size="2", tp_size="2"))
    cfg = job_config(tmp_path, "model.dtype=float32", world_size="2", tp_size="2",
                     agent_fn=str(PLUGINS / "recording_agent.py"), reward_fn_path=str(PLUGINS / "length_reward.py"))
    job = Job.start(cfg)
    try:
        assert len(job.learners) == 2 and len(job.rollouts) == 1 and job.weights.feeds == [[(0, 0)]]
        assert job.proxies[0]["gpu_ids"] == [] and job.proxies[0]["transport"] == "object_store"
        gpus = [ray.get(rank.device_where.remote())["gpu_ids"] for rank in job.learners]
        assert sorted(g for ids in gpus for g in ids) == ["0", "1"]
        refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), 0)
        job.engines.sleep(level=1)
        assert job.train(refs, summaries)["train/optimizer_steps"] == 1
        job.weights.push()
        job.engines.wake()
        job.weights.check_canary()
        ranks = ray.get([rank.named_weights.remote() for rank in job.learners])
        engine = ray.get(job.rollouts[0].named_weights.remote())
        for name, tensor in ranks[0].items():
            assert torch.equal(ranks[1][name], tensor) and torch.equal(engine[name], tensor), name
    finally:
        job.shutdown()


def test_collective_transport_on_cpu_trains_keeps_weights_equal_and_fails_fast_on_a_broken_route(ray_local, tmp_path):
    ray = ray_local
    from jobs.job import Job
    from rlsys.weights.collective import CollectiveRoute
    from rlsys.weights.transport import make_transport

    cfg = job_config(tmp_path, "model.dtype=float32", "sync.transport=collective", max_steps="2",
                     agent_fn=str(PLUGINS / "recording_agent.py"), reward_fn_path=str(PLUGINS / "length_reward.py"))
    job = Job.start(cfg)
    try:
        assert [p["transport"] for p in job.proxies] == ["collective"] and job.weights.feeds == [[(0, 0)]]
        for step in range(2):
            refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step)
            job.engines.sleep(level=1)
            stats = job.train(refs, summaries)
            assert stats["train/skipped_steps"] == 0
            assert job.weights.push() == {"sync/tensors": float(job.weights.expected_count)}
            job.engines.wake()
            assert job.weights.check_canary()["sync/canary_logp_diff"] <= job.weights.canary_tol
            learner = ray.get(job.learner.named_weights.remote())
            engine = ray.get(job.rollouts[0].named_weights.remote())
            assert learner.keys() <= engine.keys()  # the engine also lists tied weights (lm_head)
            for name, tensor in learner.items():
                assert torch.equal(engine[name], tensor), f"step {step}: engine differs on {name}"
        (route,) = job.weights.routes
        assert route.group.name == "learner-0 -> rollout-0" and route.group.world_size == 2 and route.group_rank == 1
        assert ray.get(job.learner.export_weights.remote()) is None  # the plan travelled once, with the first push

        # a broken route: each side alone fails within its timeout, naming the route
        dead = CollectiveRoute(name="learner-0 -> rollout-0 (broken)", host=route.group.host, port=_free_port(),
                               world_size=2, backend="gloo", timeout_s=3.0)
        ray.get(job.learner.open_transports.remote([make_transport("collective", dead)]))
        plan = ray.get(job.learner.export_weights.remote())  # a new transport: the plan again
        with pytest.raises(Exception, match=r"learner-0 -> rollout-0 \(broken\).*did not join") as err:
            ray.get(job.learner.send_weights.remote(), timeout=60)
        assert "learner (rank 0)" in str(err.value)
        dead = CollectiveRoute(name="learner-0 -> rollout-0 (broken)", host=route.group.host, port=_free_port(),
                               world_size=2, backend="gloo", timeout_s=3.0)
        ray.get(job.rollouts[0].set_route.remote(dataclasses.replace(route, group=dead)))
        with pytest.raises(Exception, match=r"learner-0 -> rollout-0 \(broken\)") as err:
            ray.get(job.rollouts[0].load_weights.remote(plan), timeout=60)
        assert "engine (rank 1)" in str(err.value)
    finally:
        job.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
