"""The `collective` weight transport on CPU (gloo) between two real processes, its timeouts, and how
`plan_routes` (rlsys/weights/routes.py) picks each engine's transport from where learner and engine landed."""
from __future__ import annotations

import io
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from rlsys.weights.buckets import BucketPacker
from rlsys.weights.collective import CollectiveError, CollectiveRoute, CollectiveTransport
from rlsys.weights.transport import WeightTransport, make_transport

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(push: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(push)
    return [("embed.weight", torch.randn(64, 32, generator=g)),  # 8 KiB
            ("layer.0.weight", torch.randn(32, 32, generator=g).to(torch.bfloat16)),
            ("layer.0.bias", torch.randn(32, generator=g)),
            ("step", torch.tensor([push], dtype=torch.int64)),
            ("mask", torch.rand(7, generator=g) > 0.5)]


def _route(port: int, timeout_s: float = 30.0) -> CollectiveRoute:
    return CollectiveRoute(name="learner-0 -> rollout-0", host="127.0.0.1", port=port, world_size=2,
                           backend="gloo", timeout_s=timeout_s)


def _engine(port: int, payloads, out) -> None:
    """Rank 1: receive one push per payload (the learner's `export`: the plan with the first only), report what
    arrived. The transport is made, pickled and unpickled as the driver gives it to an engine.

    The tensors go back as ``torch.save`` bytes: a tensor put on a multiprocessing queue travels as a file
    descriptor that this process must still be alive to hand over, and it exits right after the put."""
    try:
        transport = make_transport("collective", _route(port), 1)
        got = []
        for payload in payloads:
            got.append({n: t.clone() for n, t in transport.receive(payload)})
        buffer = io.BytesIO()
        torch.save(got, buffer)
        out.put(("ok", buffer.getvalue()))
    except Exception as err:  # report it to the test instead of dying silently
        out.put(("error", f"{type(err).__name__}: {err}"))


def test_gloo_broadcast_delivers_every_bucket_bit_for_bit_push_after_push():
    packer = BucketPacker.for_tensors(_weights(0), bucket_bytes=2048)  # several buckets, one oversize
    assert len(packer.plan) >= 3
    port = _free_port()
    sender = make_transport("collective", _route(port))
    assert isinstance(sender, WeightTransport)
    payloads = [sender.export(packer.pack(_weights(0))), sender.export(packer.pack(_weights(0)))]
    assert payloads == [packer.plan, None], "the plan travels with the first push only"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    engine = ctx.Process(target=_engine, args=(port, payloads, out))
    engine.start()
    try:
        for k in range(2):
            sender.send(packer.pack(_weights(k)))
        status, got = out.get(timeout=60)
        assert status == "ok", got
    finally:
        engine.join(timeout=30)
    got = torch.load(io.BytesIO(got))
    for k, received in enumerate(got):
        expected = dict(_weights(k))
        assert received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), f"push {k}: {name}"


def test_learner_side_fails_naming_the_route_when_no_engine_joins():
    packer = BucketPacker.for_tensors(_weights(0))
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"learner-0 -> rollout-0.*learner \(rank 0\).*did not join"):
        CollectiveTransport(_route(_free_port(), timeout_s=2.0)).send(packer.pack(_weights(0)))
    assert time.monotonic() - start < 30


def test_engine_side_fails_naming_the_route_when_the_learner_is_not_there():
    plan = BucketPacker.for_tensors(_weights(0)).plan
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"learner-0 -> rollout-0.*engine \(rank 1\)"):
        list(CollectiveTransport(_route(_free_port(), timeout_s=2.0), 1).receive(plan))
    assert time.monotonic() - start < 30


def test_engine_without_a_plan_and_bad_routes_are_refused():
    with pytest.raises(CollectiveError, match="no bucket plan"):
        list(CollectiveTransport(_route(_free_port()), 1).receive(None))
    with pytest.raises(ValueError, match="backend"):
        CollectiveRoute(name="r", host="h", port=1, world_size=2, backend="mpi")
    with pytest.raises(ValueError, match="rank 2"):
        CollectiveTransport(_route(1), 2)
    with pytest.raises(ValueError, match="needs its route"):
        CollectiveTransport().export([])
    with pytest.raises(ValueError, match="group rank 1 is an engine, not the learner"):
        CollectiveTransport(_route(1), 1).send([])
    with pytest.raises(ValueError, match="group rank 0 is the learner, not the engine"):
        list(CollectiveTransport(_route(1), 0).receive(BucketPacker.for_tensors(_weights(0)).plan))


def test_a_transport_travels_as_its_route_without_its_caches():
    import pickle

    sent = CollectiveTransport(_route(1), 1)
    sent._plan = [[]]  # a receiver that has taken a push
    copy = pickle.loads(pickle.dumps(sent))
    assert (copy.route, copy.rank, copy._plan, copy._group) == (sent.route, 1, None, None)
    ipc = make_transport("cuda_ipc")
    ipc._handles[(1, 2, 0)] = ("handle", [], 0)
    assert pickle.loads(pickle.dumps(ipc))._handles == {}
    for name in ("object_store", "cuda_ipc", "collective"):
        assert isinstance(make_transport(name), WeightTransport), name


# ------------------------------------------------------------------ choosing the transport by placement
def _where(node: str, gpus: list[str], on_gpu: bool) -> dict:
    return {"node_id": node, "gpu_ids": gpus, "on_gpu": on_gpu}


def test_auto_picks_cuda_ipc_on_one_gpu_collective_across_gpus_and_object_store_on_cpu():
    from rlsys.weights.routes import choose_transport

    learner = _where("n1", ["0"], True)
    assert choose_transport("auto", learner, _where("n1", ["0"], True))[0] == "cuda_ipc"
    assert choose_transport("auto", learner, _where("n1", ["1"], True))[0] == "collective"
    assert choose_transport("auto", learner, _where("n2", ["0"], True))[0] == "collective"
    assert choose_transport("auto", learner, _where("n1", ["0"], False))[0] == "object_store"  # CPU engine
    cpu = _where("n1", [], False)
    assert choose_transport("auto", cpu, cpu)[0] == "object_store"
    # fake GPUs (Ray's num_gpus on a CPU box): same GPU id, but nothing on CUDA
    assert choose_transport("auto", _where("n1", ["0"], False), _where("n1", ["0"], False))[0] == "object_store"


def test_explicit_transports_are_kept_and_cuda_ipc_across_gpus_is_refused():
    from rlsys.weights.routes import choose_transport
    from rlsys.errors import UserInputError

    cpu = _where("n1", [], False)
    transport, why = choose_transport("collective", cpu, cpu)
    assert transport == "collective" and "gloo" in why
    assert choose_transport("object_store", _where("n1", ["0"], True), _where("n1", ["0"], True))[0] == "object_store"
    assert choose_transport("cuda_ipc", cpu, cpu)[0] == "object_store"  # CPU: nothing to share, as before
    with pytest.raises(UserInputError, match="share one GPU"):
        choose_transport("collective", _where("n1", ["0"], True), _where("n1", ["0"], True))
    with pytest.raises(UserInputError, match="different nodes"):
        choose_transport("cuda_ipc", _where("n1", ["0"], True), _where("n2", ["0"], True))


# ------------------------------------------------------------------ tensor-parallel engines (vLLM's Ray executor)
def _rank(node: str, uuid: str | None) -> dict:
    return {"node_id": node, "gpu_ids": ["0"], "on_gpu": uuid is not None, "gpu_uuid": uuid}


def _vllm_engine(workers: list[tuple[str, str]], ray_executor: bool = True) -> dict:
    return {"node_id": workers[0][0], "gpu_ids": [], "on_gpu": True, "ray_executor": ray_executor,
            "workers": [{"node_id": n, "gpu_uuid": u} for n, u in workers]}


def test_engine_bundles_give_each_engine_its_consecutive_gpus():
    from jobs.placement import engine_bundles

    assert engine_bundles(4, 2) == [[0, 1], [2, 3]]
    assert engine_bundles(2, 1) == [[0], [1]]
    assert engine_bundles(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_tensor_parallel_engine_gets_each_worker_the_rank_on_its_gpu():
    from rlsys.weights.routes import choose_engine_transport

    feeders = {2: _rank("n1", "GPU-b"), 3: _rank("n1", "GPU-c")}
    # workers listed in another order than the ranks: matched by GPU, not by position
    transport, why, per_gpu = choose_engine_transport("auto", feeders, _vllm_engine([("n1", "GPU-c"), ("n1", "GPU-b")]))
    assert transport == "cuda_ipc" and per_gpu == [(3, "GPU-c"), (2, "GPU-b")] and "2 vLLM Ray worker" in why
    # one Ray worker (the tensor-parallel path at tp_size 1) takes the same route
    assert choose_engine_transport("auto", {0: _rank("n1", "GPU-a")}, _vllm_engine([("n1", "GPU-a")]))[2] == [(0, "GPU-a")]


def test_a_tensor_parallel_engine_off_its_ranks_gpus_falls_back_to_the_object_store_or_is_refused():
    from rlsys.weights.routes import choose_engine_transport
    from rlsys.errors import UserInputError

    feeders = {0: _rank("n1", "GPU-a"), 1: _rank("n1", "GPU-b")}
    elsewhere = _vllm_engine([("n1", "GPU-a"), ("n2", "GPU-b")])  # the second worker on another node
    assert choose_engine_transport("auto", feeders, elsewhere)[::2] == ("object_store", None)
    on_their_gpus = _vllm_engine([("n1", "GPU-a"), ("n1", "GPU-b")])
    assert choose_engine_transport("object_store", feeders, on_their_gpus) == (
        "object_store", "2 tensor-parallel workers, as configured", None)
    for requested in ("cuda_ipc", "collective"):
        with pytest.raises(UserInputError, match="tensor-parallel"):
            choose_engine_transport(requested, feeders, elsewhere)
    # a one-worker engine elsewhere: the pairwise choice (NCCL between GPUs)
    transport, _, per_gpu = choose_engine_transport("auto", {0: _rank("n1", "GPU-a")}, _vllm_engine([("n1", "GPU-z")]))
    assert (transport, per_gpu) == ("collective", None)


def test_an_engine_in_its_own_process_decides_by_gpu_uuid_and_cpu_engines_as_before():
    from rlsys.weights.routes import choose_engine_transport

    # vLLM with its worker in the engine process: the same physical GPU though Ray ids would differ
    engine = _vllm_engine([("n1", "GPU-a")], ray_executor=False)
    learner = {**_rank("n1", "GPU-a"), "gpu_ids": ["3"]}
    assert choose_engine_transport("auto", {0: learner}, engine) == (
        "cuda_ipc", "the same GPU", None)
    assert choose_engine_transport("auto", {0: _rank("n1", "GPU-b")}, engine)[0] == "collective"
    # the transformers engine reports no workers: Ray's GPU ids and on_gpu, as choose_transport always did
    cpu = _where("n1", ["0"], False)
    assert choose_engine_transport("auto", {0: cpu}, cpu)[0] == "object_store"


def test_per_gpu_payload_hands_each_worker_its_gpus_handles_and_names_a_missing_one():
    from rlsys.weights.transport import PerGpuPayload

    payload = PerGpuPayload({"GPU-a": ["a0", "a1"], "GPU-b": ["b0"]})
    assert payload.for_gpu("GPU-b") == ["b0"]
    with pytest.raises(RuntimeError, match="GPU-c.*GPU-a"):
        payload.for_gpu("GPU-c")


def test_rollout_actor_options_put_vllm_ray_workers_on_the_engine_bundles():
    from jobs.placement import ROLLOUT_GPU_SHARE, rollout_placement
    from rlsys.config import load_config

    pg = object()  # only carried into the scheduling strategy
    tp = rollout_placement(load_config(overrides=["cluster.world_size=4", "cluster.tp_size=2"]).vllm_ray_executor(),
                           pg, [2, 3])
    env = tp["runtime_env"]["env_vars"]
    assert tp["num_gpus"] == 0 and env["VLLM_RAY_BUNDLE_INDICES"] == "2,3"
    assert float(env["VLLM_RAY_PER_WORKER_GPUS"]) == ROLLOUT_GPU_SHARE
    strategy = tp["scheduling_strategy"]
    assert strategy.placement_group_bundle_index == 2 and strategy.placement_group_capture_child_tasks
    one = rollout_placement(load_config(overrides=["cluster.world_size=2"]).vllm_ray_executor(), pg, [1])
    assert one["num_gpus"] == ROLLOUT_GPU_SHARE and "VLLM_RAY_BUNDLE_INDICES" not in one["runtime_env"]["env_vars"]
    assert not one["scheduling_strategy"].placement_group_capture_child_tasks
    ray_at_tp1 = rollout_placement(load_config(overrides=["rollout.executor=ray"]).vllm_ray_executor(), pg, [0])
    assert ray_at_tp1["runtime_env"]["env_vars"]["VLLM_RAY_BUNDLE_INDICES"] == "0"


def test_the_route_plan_gives_every_engine_its_route_and_every_rank_its_transports():
    from rlsys.weights.routes import EngineRoute, plan_routes

    # two GPUs on one node, engine e on rank e's GPU: CUDA IPC each, ranks on GPUs -> nccl for any collective route
    ranks = [_rank("n1", "GPU-a"), _rank("n1", "GPU-b")]
    engines = [_vllm_engine([("n1", "GPU-a")], ray_executor=False), _vllm_engine([("n1", "GPU-b")], ray_executor=False)]
    plan = plan_routes("auto", ranks, [[0], [1]], engines)
    assert plan.routes == (EngineRoute("cuda_ipc", 0, "the same GPU"), EngineRoute("cuda_ipc", 1, "the same GPU"))
    assert plan.collective_backend == "nccl" and plan.transports_of(0) == plan.transports_of(1) == ["cuda_ipc"]
    # engine 1 on a third GPU: a broadcast from rank 1; rank 0 feeds only its own GPU's engine
    plan = plan_routes("auto", ranks, [[0], [1]], [engines[0], _vllm_engine([("n1", "GPU-z")], ray_executor=False)])
    assert [r.transport for r in plan.routes] == ["cuda_ipc", "collective"]
    assert plan.transports_of(0) == ["cuda_ipc"] and plan.transports_of(1) == ["collective"]
    # a tensor-parallel engine over both ranks' GPUs: one route with a shard per worker, fed by both ranks
    plan = plan_routes("auto", ranks, [[0, 1]], [_vllm_engine([("n1", "GPU-b"), ("n1", "GPU-a")])])
    (route,) = plan.routes
    assert route.per_gpu == ((1, "GPU-b"), (0, "GPU-a")) and route.fed_by() == "learner-1, learner-0"
    assert plan.transports_of(0) == plan.transports_of(1) == ["cuda_ipc"]
    # CPU: the object store, gloo for a configured collective route, and a rank that feeds nothing opens nothing
    cpu = _where("n1", [], False)
    plan = plan_routes("collective", [cpu, cpu], [[0]], [cpu])
    assert plan.routes[0].transport == "collective" and plan.collective_backend == "gloo"
    assert plan.transports_of(1) == [] and plan.routes[0].fed_by() == "learner-0"
    assert plan_routes("auto", [cpu], [[0]], [cpu]).routes[0].transport == "object_store"
