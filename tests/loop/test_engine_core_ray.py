"""What vLLM's engine-core process sees of the job's Ray, without a GPU: its RAY_ADDRESS and the job's placement group.

vLLM's Ray executor runs inside the engine-core process: it calls `ray.init()` (address from RAY_ADDRESS) and reads
the bundles of the placement group that vLLM pickled from the rollout actor. The GPU suite once failed there
(`KeyError: 'bundles'`): with VLLM_WORKER_MULTIPROC_METHOD=spawn in the actor's environment vLLM never set
RAY_ADDRESS, the engine core started a Ray of its own, and the job's group was not in it. Here a Ray actor in a
placement group, with that variable set, starts its engine-core stand-in the two ways `rollout.engine_process`
allows (forked from rlsys's fork server, or spawned as vLLM does), and the child joins Ray as vLLM's would.
"""
from __future__ import annotations

import multiprocessing
import os

import pytest

from tests.loop.conftest import REPO

pytestmark = pytest.mark.timeout(300)


def engine_core_view(queue, placement_group) -> None:
    """The engine-core stand-in: what vLLM's `initialize_ray_cluster` does first, reported back."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:  # vLLM would call ray.init() here and start a Ray of its own
        queue.put({"address": None, "bundles": None})
        return
    import ray

    ray.init()  # as vLLM does: the address comes from RAY_ADDRESS
    try:
        queue.put({"address": ray.get_runtime_context().gcs_address, "bundles": placement_group.bundle_specs})
    finally:
        ray.shutdown()


class RolloutStandIn:
    """The rollout actor's first steps of `start` for a vLLM engine, then one engine-core child."""

    def engine_core_sees(self, process: str) -> dict:
        import ray

        from rlsys.engines.vllm_engine import export_ray_address, start_engine_core_server

        export_ray_address()
        if process == "forkserver":
            ctx = start_engine_core_server(("colorsys",))  # a stand-in preload: no vLLM on this box
        else:
            ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=engine_core_view, args=(queue, ray.util.get_current_placement_group()))
        child.start()
        try:
            return {**queue.get(timeout=180), "actor_address": ray.get_runtime_context().gcs_address,
                    "multiproc_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")}
        finally:
            child.join(timeout=60)


@pytest.mark.parametrize("process", ["forkserver", "spawn"])
def test_the_engine_core_joins_the_jobs_ray_and_sees_its_placement_group(ray_local, process):
    ray = ray_local
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 1}], name=f"rlsys-test-{process}")
    ray.get(pg.ready(), timeout=60)
    try:
        actor = ray.remote(RolloutStandIn).options(
            num_cpus=0, runtime_env={"env_vars": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTHONPATH": str(REPO)}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0),
        ).remote()
        seen = ray.get(actor.engine_core_sees.remote(process), timeout=240)
        ray.kill(actor)
    finally:
        remove_placement_group(pg)
    assert seen["multiproc_method"] == "spawn", "the setting under which vLLM leaves RAY_ADDRESS unset"
    assert seen["address"] == seen["actor_address"] == ray.get_runtime_context().gcs_address, seen
    assert seen["bundles"] == [{"CPU": 1.0}], seen
