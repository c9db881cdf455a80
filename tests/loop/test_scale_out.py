"""World size 2 on a simulated 2-node cluster with fake GPUs (ray.cluster_utils.Cluster): actors land as
planned, the learner ranks train as one gloo process group, and after every push both learner ranks and
both engines hold the same weights."""
from __future__ import annotations

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


def test_world_size_two_places_trains_and_keeps_weights_equal(two_nodes, tmp_path):
    ray = two_nodes
    from jobs.cluster import Job

    cfg = job_config(tmp_path, "cluster.placement_strategy=SPREAD", "model.dtype=float32", world_size="2",
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
        assert {p["transport"] for p in job.proxies} == {"object_store"}  # fake GPUs: no CUDA to share

        for step in range(2):
            refs, summaries = job.rollout(job.data.next_batch(cfg.rollout.batch_size), step)
            job.engines.sleep(level=1)
            stats = job.train(refs, summaries)
            assert stats["train/skipped_steps"] == 0 and stats["train/optimizer_steps"] == step + 1
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
    finally:
        job.shutdown()
