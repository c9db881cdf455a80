"""CPU-side checks of the GPU weight path (not marked `gpu`: they run in CPU CI too).

What can be checked without CUDA or vLLM: the device-index patch of IPC rebuild args, the receiver's mapping
cache, the direct-copy plan against a vLLM-like model with fused q/k/v and gate/up and a padded vocabulary,
the worker extension end to end with CPU buffers and a fake IPC rebuild, the engine's sleep/wake/dropped-
weights state with a fake AsyncLLM, the memory budget, and that none of these modules imports vLLM or Ray.
"""
from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rlsys.weights.buckets import BucketPacker
from rlsys.weights.transport import (
    CudaIpcTransport,
    DirectCopyPlan,
    IpcBucket,
    IpcBufferCache,
    handle_key,
    layout_id,
    make_transport,
    rebuild_ipc,
)
from tests.gpu.conftest import REPO


# ------------------------------------------------------------------ a fake IPC handle over CPU buffers
_SHARED: dict[bytes, torch.Tensor] = {}  # "GPU memory" both sides see: handle -> buffer
_REBUILDS: list[list] = []


def _fake_rebuild_cuda_tensor(*args):
    # module-level, so a pickled handle still points at the shared buffers (as a real IPC handle does)
    _REBUILDS.append(list(args))
    return _SHARED[args[7]]


class FakeIpc:
    """Handles shaped like torch's reduce_tensor output, whose 'rebuild' returns a shared CPU buffer."""

    rebuilds = _REBUILDS

    def handle(self, name: bytes, buf: torch.Tensor) -> tuple:
        _SHARED[name] = buf
        args = [torch.Tensor, buf.shape, (1,), 0, object, torch.uint8, 3, name, buf.numel(), 0, False,
                b"ref", 0, b"event", True]
        return (_fake_rebuild_cuda_tensor, tuple(args))


def test_rebuild_ipc_patches_the_device_index_and_nothing_else():
    ipc = FakeIpc()
    buf = torch.zeros(16, dtype=torch.uint8)
    handle = ipc.handle(b"h0", buf)
    assert rebuild_ipc(handle, device_index=0) is buf
    sent, got = list(handle[1]), ipc.rebuilds[-1]
    assert sent[6] == 3 and got[6] == 0, "the receiver's own device index replaces the sender's"
    assert got[:6] == sent[:6] and got[7:] == sent[7:]
    assert handle_key(handle) == (b"h0", 0, 16)


def test_ipc_cache_opens_each_buffer_once_and_drops_buffers_a_push_no_longer_sends():
    ipc = FakeIpc()
    a, b, c = (torch.zeros(8, dtype=torch.uint8) for _ in range(3))
    cache = IpcBufferCache(rebuild=lambda h, d: rebuild_ipc(h, d))
    push1 = [IpcBucket(ipc.handle(b"a", a), [], 8), IpcBucket(ipc.handle(b"b", b), [], 8)]
    assert cache.open(push1, 0) == [a, b] and cache.opened == 2
    assert cache.open(push1, 0) == [a, b] and cache.opened == 2 and cache.reused == 2
    push2 = [IpcBucket(ipc.handle(b"a", a), [], 8), IpcBucket(ipc.handle(b"c", c), [], 8)]
    cache.open(push2, 0)
    assert cache.opened == 3
    assert set(cache._buffers) == {handle_key(push2[0].handle), handle_key(push2[1].handle)}
    with pytest.raises(ValueError, match="expected \\(9,\\) uint8"):
        cache.open([IpcBucket(ipc.handle(b"a", a), [], 9)], 0)


def test_metas_travel_as_bytes_pickled_once_and_are_unpickled_only_for_views_not_made_yet():
    ipc = FakeIpc()
    named = hf_weights(0)
    bucket = BucketPacker.for_tensors(named, bucket_bytes=1 << 20).pack(named)[0]
    blob = pickle.dumps(bucket.metas)
    sent = IpcBucket(ipc.handle(b"m", bucket.buffer), bucket.metas, bucket.nbytes, layout=layout_id(bucket.metas),
                     blob=blob)
    wire = pickle.dumps([sent])
    assert blob in wire, "the sender's pickle of the metas travels as it is"
    arrived = pickle.loads(wire)[0]
    assert arrived.metas is None and arrived.blob == blob and arrived.layout == sent.layout
    cache = IpcBufferCache(rebuild=lambda h, d: rebuild_ipc(h, d))
    views = cache.views([arrived], 0)
    assert arrived.metas == bucket.metas
    assert [n for n, _ in views] == [n for n, _ in named]
    assert all(torch.equal(v, t) for (_, v), (_, t) in zip(views, named))
    again = pickle.loads(pickle.dumps(pickle.loads(wire)))[0]  # a second push, after one more hop
    views_again = cache.views([again], 0)
    assert all(x is y for (_, x), (_, y) in zip(views_again, views)) and len(views_again) == len(views)
    assert again.metas is None, "cached views: the metas stay bytes"
    plain = pickle.loads(pickle.dumps(IpcBucket(sent.handle, bucket.metas, bucket.nbytes)))  # made without a blob
    assert plain.tensor_metas() == bucket.metas


def test_fused_pack_fills_the_same_buffers_as_the_packer_and_falls_back_on_a_changed_layout():
    from rlsys.weights.buckets import unpack_bucket
    from rlsys.weights.transport import FusedPack

    first = hf_weights(0)
    packer = BucketPacker.for_tensors(first, bucket_bytes=512)
    fused = FusedPack(packer, first)
    second = hf_weights(1)
    buckets = fused.pack(second)
    assert buckets is fused.buckets and [b.buffer for b in buckets] == packer.buffers
    got = {n: t.clone() for b in buckets for n, t in unpack_bucket(b)}
    assert all(torch.equal(got[n], t) for n, t in second)
    with pytest.raises(ValueError, match="not given"):  # the packer's own checks name what differs
        fused.pack(second[:-1])


def test_cuda_ipc_export_refuses_cpu_buffers():
    packer = BucketPacker([("w", (4,), torch.float32)])
    buckets = packer.pack([("w", torch.ones(4))])
    with pytest.raises(ValueError, match="CUDA tensors"):
        CudaIpcTransport().export(buckets)
    assert make_transport("cuda_ipc").name == "cuda_ipc"
    assert make_transport("auto").name == "object_store"
    with pytest.raises(ValueError, match="unknown"):
        make_transport("nccl")


# ------------------------------------------------------------------ a vLLM-like model
H, NQ, NKV, HD, I, V, VPAD = 8, 2, 1, 4, 12, 10, 16


class FakeVllmModel(torch.nn.Module):
    """Fused qkv_proj / gate_up_proj and a vocabulary padded to 16 rows, like vLLM's Qwen2 at TP=1."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, qkv_order=("q_proj", "k_proj", "v_proj")) -> None:
        super().__init__()
        self.qkv_order = qkv_order
        p = lambda *shape: torch.nn.Parameter(torch.zeros(*shape))  # noqa: E731
        self.params = torch.nn.ParameterDict({
            "embed": p(VPAD, H), "qkv_w": p((NQ + 2 * NKV) * HD, H), "qkv_b": p((NQ + 2 * NKV) * HD),
            "gate_up": p(2 * I, H), "down": p(H, I), "norm": p(H),
        })
        self.register_buffer("cos_sin_cache", torch.arange(6.0))  # not a parameter: must survive pushes

    def named_parameters(self, *args, **kwargs):
        names = {"embed": "model.embed_tokens.weight", "qkv_w": "model.layers.0.self_attn.qkv_proj.weight",
                 "qkv_b": "model.layers.0.self_attn.qkv_proj.bias", "gate_up": "model.layers.0.mlp.gate_up_proj.weight",
                 "down": "model.layers.0.mlp.down_proj.weight", "norm": "model.norm.weight"}
        for key, param in self.params.items():
            yield names[key], param

    @torch.no_grad()
    def load_weights(self, weights):
        """What vLLM's loader does at TP=1: shards into row blocks of the fused parameters, padded vocab."""
        params = dict(self.named_parameters())
        sizes = {"q_proj": NQ * HD, "k_proj": NKV * HD, "v_proj": NKV * HD, "gate_proj": I, "up_proj": I}
        loaded = set()
        for name, tensor in weights:
            for fused, shards in (("qkv_proj", self.qkv_order), ("gate_up_proj", ("gate_proj", "up_proj"))):
                shard = next((s for s in shards if f".{s}." in name), None)
                if shard is not None:
                    target = name.replace(shard, fused)
                    offset = sum(sizes[s] for s in shards[: shards.index(shard)])
                    params[target].narrow(0, offset, sizes[shard]).copy_(tensor)
                    loaded.add(target)
                    break
            else:
                params[name].narrow(0, 0, tensor.shape[0]).copy_(tensor)
                loaded.add(name)
        return loaded


def hf_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    pre = "model.layers.0."
    return [("model.embed_tokens.weight", r(V, H)), (pre + "self_attn.q_proj.weight", r(NQ * HD, H)),
            (pre + "self_attn.k_proj.weight", r(NKV * HD, H)), (pre + "self_attn.v_proj.weight", r(NKV * HD, H)),
            (pre + "self_attn.q_proj.bias", r(NQ * HD)), (pre + "self_attn.k_proj.bias", r(NKV * HD)),
            (pre + "self_attn.v_proj.bias", r(NKV * HD)), (pre + "mlp.gate_proj.weight", r(I, H)),
            (pre + "mlp.up_proj.weight", r(I, H)), (pre + "mlp.down_proj.weight", r(H, I)),
            ("model.norm.weight", r(H))]


def describe(named):
    return [(n, t.shape, t.dtype) for n, t in named]


def test_direct_copy_plan_matches_the_models_own_loader_and_then_replaces_it():
    model = FakeVllmModel()
    first = hf_weights(0)
    model.load_weights(first)
    plan, reason = DirectCopyPlan.build(model, describe(first))
    assert plan is not None, reason
    assert plan.verify(first) == ""
    second = hf_weights(1)
    assert plan.copy(second) == len(second)
    reference = FakeVllmModel()
    reference.load_weights(second)
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got, want), name
    assert torch.equal(model.cos_sin_cache, torch.arange(6.0)), "buffers are not touched"


def test_direct_copy_plan_is_refused_when_the_guess_is_wrong_or_incomplete():
    swapped = FakeVllmModel(qkv_order=("q_proj", "v_proj", "k_proj"))  # a loader laying shards out differently
    first = hf_weights(0)
    swapped.load_weights(first)
    plan, reason = DirectCopyPlan.build(swapped, describe(first))
    assert plan is not None and "wrote something else" in plan.verify(first)

    model = FakeVllmModel()
    plan, reason = DirectCopyPlan.build(model, describe(first[:-1]))  # model.norm.weight never sent
    assert plan is None and "receive nothing" in reason
    plan, reason = DirectCopyPlan.build(model, describe([*first, ("model.extra.weight", torch.zeros(2))]))
    assert plan is None and "model.extra.weight" in reason
    half = [(n, t[: t.shape[0] // 2]) if "gate_proj" in n or "up_proj" in n else (n, t) for n, t in first]
    plan, reason = DirectCopyPlan.build(model, describe(half))  # tensor-parallel shards do not fill the rows
    assert plan is None and "gate_up_proj" in reason


def test_direct_copy_plan_notices_parameters_that_moved():
    model = FakeVllmModel()
    first = hf_weights(0)
    plan, _ = DirectCopyPlan.build(model, describe(first))
    assert plan.still_valid()
    model.params["norm"].data = torch.zeros(H)
    assert not plan.still_valid()


# ------------------------------------------------------------------ the worker extension, CPU edition
def make_worker():
    from actors.vllm_ext import WorkerExtension

    class Worker(WorkerExtension):  # what vLLM does: the extension mixed into its worker class
        def __init__(self) -> None:
            self.device = torch.device("cpu", 0)
            self.model_runner = SimpleNamespace(model=FakeVllmModel())

    return Worker()


def test_worker_loads_ipc_buckets_first_through_load_weights_then_by_direct_copy():
    ipc = FakeIpc()
    worker = make_worker()
    worker._rlsys_transport = CudaIpcTransport(receiver=IpcBufferCache(rebuild=lambda h, d: rebuild_ipc(h, d)))
    first = hf_weights(0)
    packer = BucketPacker.for_tensors(first, bucket_bytes=512)  # several buckets

    def payload(named):
        buckets = packer.pack(named)
        return pickle.dumps([IpcBucket(ipc.handle(f"b{i}".encode(), b.buffer), b.metas, b.nbytes,
                                       layout=layout_id(b.metas)) for i, b in enumerate(buckets)])

    info = worker.rlsys_load_weights(payload(first))
    assert info["count"] == len(first) and info["path"] == "load_weights" and info["missing"] == []
    assert info["plan_refused"] is None and info["opened"] == len(packer.buffers)
    second = hf_weights(1)
    info = worker.rlsys_load_weights(payload(second))
    assert info["path"] == "direct" and info["opened"] == len(packer.buffers), "mappings are reused"
    reference = FakeVllmModel()
    reference.load_weights(second)
    got = pickle.loads(worker.rlsys_get_weights())
    for name, want in reference.named_parameters():
        assert torch.equal(got[name], want), name


def test_worker_fingerprint_follows_each_push_through_the_views_it_keeps():
    """`rlsys_fingerprint` keeps its integer views with the direct-copy plan (`WordSums`), so after each push it
    must read the new weights: the sums of what the learner packed, push after push; a moved parameter: None."""
    from rlsys.weights.fingerprint import bucket_sums

    worker = make_worker()
    transport = make_transport("object_store")
    worker.rlsys_set_transport(pickle.dumps(transport))
    assert worker.rlsys_fingerprint() is None  # no plan before the first push
    for seed in range(3):  # the first push builds the plan; the next ones copy through it
        weights = hf_weights(seed)
        buckets = BucketPacker.for_tensors(weights).pack(weights)
        worker.rlsys_load_weights(pickle.dumps(transport.export(buckets)))
        assert worker.rlsys_fingerprint() == bucket_sums(buckets), f"push {seed}"
    kept = worker._rlsys_word_sums
    worker.rlsys_fingerprint()
    assert worker._rlsys_word_sums is kept  # one set of views per plan
    worker.model_runner.model.params["norm"].data = torch.zeros(H)  # the engine reallocated a parameter
    assert worker.rlsys_fingerprint() is None


def test_worker_loads_cpu_buckets_of_the_object_store_transport():
    worker = make_worker()
    first = hf_weights(0)
    transport = make_transport("object_store")
    payload = transport.export(BucketPacker.for_tensors(first).pack(first))
    worker.rlsys_set_transport(pickle.dumps(transport))
    info = worker.rlsys_load_weights(pickle.dumps(payload))
    assert info["count"] == len(first) and info["missing"] == []


# ------------------------------------------------------------------ the engine's state, with a fake AsyncLLM
class FakeLLM:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def sleep(self, level):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return [{"count": 11, "missing": [], "path": "direct", "worker_ms": 0.1}]


def test_engine_refuses_to_serve_after_level_2_until_a_push_and_wakes_weights_first():
    from rlsys.engines.vllm_engine import VLLMEngine, WEIGHTS_DROPPED

    llm = FakeLLM()
    engine = VLLMEngine.around(llm, max_model_len=64, vocab_size=32)

    async def scenario():
        await engine.sleep(2)
        transport = make_transport("cuda_ipc")
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.load_payload(transport, [])
        await engine.wake()  # both tags: weights must come first
        with pytest.raises(RuntimeError, match="dropped"):
            await engine.score([1], [2])
        assert await engine.load_payload(transport, []) == 11
        assert await engine.load_payload(transport, []) == 11  # the workers keep their transport: no second set
        assert not engine.weights_dropped
        await engine.wake(["kv_cache"])  # already awake: no second wake_up
        await engine.sleep(1)
        assert engine.is_sleeping and not engine.weights_dropped
        await engine.wake(["weights"])
        with pytest.raises(RuntimeError, match="asleep"):
            await engine.generate([1], __import__("rlsys.engines", fromlist=["SamplingParams"]).SamplingParams())

    asyncio.run(scenario())
    assert ("wake_up", ("weights", "kv_cache")) in llm.calls
    assert llm.calls.count(("rpc", "rlsys_set_transport")) == 1 and llm.calls.count(("rpc", "rlsys_load_weights")) == 2
    assert [c for c in llm.calls if c[0] == "wake_up"][-1] == ("wake_up", ("weights",))
    assert "dropped" in WEIGHTS_DROPPED


def test_engine_refuses_unknown_transports_and_ids_outside_the_vocabulary():
    from rlsys.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.around(FakeLLM(), max_model_len=64, vocab_size=32)
    with pytest.raises(ValueError, match="transport"):
        asyncio.run(engine.load_payload(SimpleNamespace(name="carrier_pigeon"), []))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(engine.score([1, 99], [2]))


def test_logprob_lookup_and_finish_reasons():
    from rlsys.engines.vllm_engine import finish_reason, logprob_of

    assert logprob_of({5: SimpleNamespace(logprob=-1.5)}, 5) == -1.5
    with pytest.raises(RuntimeError, match="lack"):
        logprob_of({4: SimpleNamespace(logprob=-1.0)}, 5)
    assert finish_reason("stop") == "stop" and finish_reason("length") == "length"
    with pytest.raises(RuntimeError, match="abort"):
        finish_reason("abort")


def test_memory_budget_becomes_a_fraction_of_the_device():
    from rlsys.engines.vllm_engine import GIB, memory_fraction

    assert memory_fraction(None, 120 * GIB) == pytest.approx(1 / 3)
    assert memory_fraction(30.0, 120 * GIB) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="gpu_memory_budget_gib"):
        memory_fraction(119.0, 120 * GIB)


def test_gpu_actor_env_carries_the_vllm_switches_and_the_repo():
    pytest.importorskip("ray")
    from jobs.placement import gpu_actor_env

    env = gpu_actor_env()
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert str(REPO) in env["PYTHONPATH"].split(":")


def test_gpu_modules_import_without_vllm_or_ray():
    code = ("import sys, rlsys, rlsys.engines.vllm_engine, rlsys.weights.transport, actors.vllm_ext; "
            "bad = [m for m in ('vllm', 'ray') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
