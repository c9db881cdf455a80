"""Weight transports: how packed buckets travel from the learner to the engine.

All transports share one shape (`WeightTransport`): the learner side turns its buckets into a payload (`export`)
and sends whatever does not travel in it (`send`: the collective's broadcasts; nothing for the others), Ray carries
the payload to the rollout actor, and the engine side turns it back into named tensors (`receive`). Each side is
given its transport object once, when the job starts (rlsys/weights/routes.py plans them); a push names none, and
neither the driver nor the actors branch on which one is used (NeMo-RL's `sync_weights()` habit). A transport
pickles as a fresh one (its route, none of its caches): handles, mappings and groups belong to one process.

- `object_store`: the buckets themselves (CPU tensors), copied through Ray's object store. CPU runs,
  and learner and engine on different nodes.
- `cuda_ipc`: one CUDA IPC handle per bucket (learner and engine on the same GPU). The payload is a few
  hundred bytes per bucket; the engine process maps the learner's buffer and copies from it in place.
- `collective` (rlsys/weights/collective.py): one NCCL (GPU) or gloo (CPU) broadcast per bucket over a group
  of the source learner rank and its engines, given to both sides at start; two-sided: the payload is the bucket
  plan (first push only) and `send` broadcasts while the engine receives. For learner and engine on different GPUs
  or nodes.

The CUDA IPC path is built to make a push cost little more than the copies themselves:
- The learner's `BucketPacker` allocates its buffers once, so `CudaIpcTransport` makes each buffer's
  handle once (`reduce_tensor`) and hands out the same handle every push; the learner synchronises its
  stream before exporting, so the engine may read as soon as it has the handle.
- The receiver keeps each opened mapping (`IpcBufferCache`, keyed by the handle) for the next push: opening
  a handle (`cudaIpcOpenMemHandle`) is the expensive part, tens of ms per GiB; a cached mapping is free.
- `DirectCopyPlan` turns a verified first load into per-tensor destination views, so later pushes are one
  `torch._foreach_copy_` instead of the model's Python `load_weights` (see its docstring).

Torch only (no Ray, no vLLM): the vLLM worker extension (actors/vllm_ext.py) imports this module.
"""
from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlsys.weights.buckets import TensorMeta, WeightBucket, unpack_bucket
from rlsys.weights.collective import CollectiveTransport

# Position of the device index and the allocation handle in the args of torch's `rebuild_cuda_tensor`
# (torch/multiprocessing/reductions.py: reduce_tensor): (tensor_cls, size, stride, tensor_offset, storage_cls,
# dtype, storage_device, storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad, ...).
_DEVICE_ARG = 6
_HANDLE_ARG = 7
_SIZE_ARG = 8
_OFFSET_ARG = 9


@runtime_checkable
class WeightTransport(Protocol):
    """How packed buckets travel from a learner rank to an engine; one object per side, given at job start."""

    name: str  # "object_store", "cuda_ipc" or "collective": for logs and errors only
    # True when the route has one receiving rank per engine (collective): an engine of several workers cannot use it
    one_receiver: bool

    def export(self, buckets: list[WeightBucket]) -> Any:
        """Learner side: the payload Ray carries to the engine for these (packed) buckets."""

    def send(self, buckets: list[WeightBucket]) -> None:
        """Learner side, after `export`, while the engines receive: what does not travel in the payload."""

    def receive(self, payload: Any, device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine side: (name, tensor) of every weight in ``payload``, on ``device`` (None: where this process's
        engine keeps its weights, the current CUDA device or the CPU)."""

    def counters(self) -> dict[str, int]:
        """Engine side: what the receiver reused or opened so far (CUDA IPC mappings), for the push's report."""


class ObjectStoreTransport:
    name = "object_store"
    one_receiver = False

    def export(self, buckets: list[WeightBucket]) -> list[WeightBucket]:
        # the packer refills its buffers on the next push: hand out copies, never its own storage
        return [WeightBucket(buffer=b.buffer.to("cpu", copy=True), metas=b.metas) for b in buckets]

    def send(self, buckets: list[WeightBucket]) -> None:
        """Nothing: the buckets travel in the payload."""

    def receive(self, payload: list[WeightBucket],
                device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The CPU buckets' views, or with ``device`` (vLLM's worker) their copies there, one copy per bucket."""
        for bucket in payload:
            if device is not None:
                bucket = WeightBucket(buffer=bucket.buffer.to(device, non_blocking=True), metas=bucket.metas)
            yield from unpack_bucket(bucket)

    def counters(self) -> dict[str, int]:
        return {}


# ---------------------------------------------------------------------------------------------- CUDA IPC
@dataclass
class IpcBucket:
    """One bucket as the CUDA IPC payload carries it: the buffer's rebuild handle and its tensor layout.

    The metas travel as ``blob``, their pickle made once by the sender (`CudaIpcTransport.export` keeps it with the
    handle), and are unpickled on arrival only when the receiver has no views for this buffer and ``layout`` yet
    (`IpcBufferCache.views`): pickling and unpickling the 392 metas of a 7B model's r=16 adapter took ~1.5 ms a
    push on this project's CPU box, more than the copies it describes. Every hop of a payload (learner -> Ray ->
    rollout actor -> vLLM's engine core) then pickles bytes."""

    handle: tuple[Any, tuple]  # (rebuild_cuda_tensor, args) from torch.multiprocessing.reductions.reduce_tensor
    metas: list[TensorMeta] | None  # None on arrival until `tensor_metas` unpickles ``blob``
    nbytes: int  # buffer size, (N,) uint8
    layout: int = 0  # identifies `metas` (same tensors at the same offsets): the receiver reuses its views
    blob: bytes | None = field(default=None, repr=False, compare=False)  # pickle.dumps(metas), made once

    def __reduce__(self) -> tuple:
        blob = self.blob if self.blob is not None else pickle.dumps(self.metas)
        return (_arrived_bucket, (self.handle, blob, self.nbytes, self.layout))

    def tensor_metas(self) -> list[TensorMeta]:
        """Where each tensor lies in the buffer (unpickled from ``blob`` on first use)."""
        if self.metas is None:
            self.metas = pickle.loads(self.blob)
        return self.metas


def _arrived_bucket(handle: tuple[Any, tuple], blob: bytes, nbytes: int, layout: int) -> IpcBucket:
    return IpcBucket(handle=handle, metas=None, nbytes=nbytes, layout=layout, blob=blob)


def layout_id(metas: list[TensorMeta]) -> int:
    return hash(tuple((m.name, str(m.dtype), m.shape, m.offset) for m in metas))


def handle_key(handle: tuple[Any, Sequence[Any]]) -> tuple[bytes, int, int]:
    """What identifies the mapped memory of a handle: (allocation handle, offset, size in bytes)."""
    _, args = handle
    return bytes(args[_HANDLE_ARG]), int(args[_OFFSET_ARG]), int(args[_SIZE_ARG])


def rebuild_ipc(handle: tuple[Any, Sequence[Any]], device_index: int) -> torch.Tensor:
    """Open a `reduce_tensor` handle in this process on ``device_index``.

    The handle records the sender's device index; the receiver may number the same GPU differently
    (another CUDA_VISIBLE_DEVICES), so the index is replaced by the receiver's own (vLLM's rlhf_utils.py).
    """
    func, args = handle
    args = list(args)
    args[_DEVICE_ARG] = int(device_index)
    return func(*args)


class CudaIpcTransport:
    """Learner side: one handle per (reused) bucket buffer; engine side: `receive` opens them (`IpcBufferCache`).

    Engines whose weights live in another process (vLLM's engine core) give that process a copy of this transport
    once and forward each payload to it.
    """

    name = "cuda_ipc"
    one_receiver = False

    def __init__(self, receiver: IpcBufferCache | None = None) -> None:
        # (ptr, nbytes, device) -> (handle, metas, layout id, pickled metas), made at a buffer's first push
        self._handles: dict[tuple[int, int, int], tuple[Any, list[TensorMeta], int, bytes]] = {}
        self._receiver = receiver or IpcBufferCache()

    def __getstate__(self) -> dict:
        return {}  # handles are the sender's, mappings the receiver's: a copy starts empty

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def export(self, buckets: list[WeightBucket]) -> list[IpcBucket]:
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

        for b in buckets:
            if not b.buffer.is_cuda:
                raise ValueError(
                    f"cuda_ipc: bucket buffers must be CUDA tensors, got one on {b.buffer.device}; "
                    "use sync.transport=object_store without a GPU"
                )
        # The receiver reads as soon as it has the handle, and a cached handle carries no fresh CUDA event:
        # finish the packing copies first.
        for device in {b.buffer.device for b in buckets}:
            torch.cuda.current_stream(device).synchronize()
        payload = []
        for b in buckets:
            key = (b.buffer.data_ptr(), b.buffer.numel(), b.buffer.device.index)
            cached = self._handles.get(key)
            if cached is None or (cached[1] is not b.metas and cached[1] != b.metas):  # first push of this buffer
                cached = (reduce_tensor(b.buffer), b.metas, layout_id(b.metas), pickle.dumps(b.metas))
                self._handles[key] = cached
            handle, metas, layout, blob = cached
            payload.append(IpcBucket(handle=handle, metas=metas, nbytes=b.buffer.numel(), layout=layout, blob=blob))
        return payload

    def send(self, buckets: list[WeightBucket]) -> None:
        """Nothing: the handles travel in the payload."""

    def receive(self, payload: list[IpcBucket] | PerGpuPayload,
                device: torch.device | None = None) -> list[tuple[str, torch.Tensor]]:
        """(name, view) pairs on ``device`` (default: this process's current CUDA device), the views sharing the
        learner's buffers; a `PerGpuPayload` gives this device's GPU's handles. Opened buffers are kept for the
        next push."""
        index = torch.cuda.current_device() if device is None else device.index
        if isinstance(payload, PerGpuPayload):
            payload = payload.for_gpu(gpu_uuid(index if device is None else device))
        return self._receiver.views(payload, index)

    def counters(self) -> dict[str, int]:
        return {"opened": self._receiver.opened, "reused": self._receiver.reused}


def gpu_uuid(device: torch.device | int) -> str:
    """The physical identity of a CUDA device: the same string in every process that sees it, whatever its
    local index there (a learner sees its one GPU as cuda:0, a vLLM Ray worker sees them all)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class PerGpuPayload:
    """One push to a tensor-parallel engine: each worker takes the CUDA IPC payload of the learner rank on its
    own GPU (`by_gpu`: GPU uuid -> list of `IpcBucket`), since a handle opens only on the device it came from.
    Every payload holds the whole model; vLLM's `load_weights` keeps each worker's shard."""

    by_gpu: dict[str, list[IpcBucket]]

    def for_gpu(self, uuid: str) -> list[IpcBucket]:
        payload = self.by_gpu.get(uuid)
        if payload is None:
            raise RuntimeError(f"cuda_ipc: no learner rank sent weights for GPU {uuid} (sent for "
                               f"{sorted(self.by_gpu)}): each engine worker needs a learner rank on its GPU")
        return payload


class IpcBufferCache:
    """Receiver side of `cuda_ipc`: opened buffers kept across pushes, keyed by their handle.

    Only the buffers of the latest push are kept: if the sender ever hands out new buffers, the old
    mappings are released instead of piling up.
    """

    def __init__(self, rebuild=rebuild_ipc) -> None:
        self._rebuild = rebuild
        self._buffers: dict[tuple[bytes, int, int], torch.Tensor] = {}
        self._views: dict[tuple, list[tuple[str, torch.Tensor]]] = {}  # (handle key, layout) -> named views
        self.opened = 0  # handles opened (cache misses) since construction
        self.reused = 0  # cache hits

    def open(self, payload: list[IpcBucket], device_index: int) -> list[torch.Tensor]:
        """The (N,) uint8 buffer of every bucket, in payload order."""
        kept: dict[tuple[bytes, int, int], torch.Tensor] = {}
        out = []
        for bucket in payload:
            key = handle_key(bucket.handle)
            buf = kept.get(key)
            if buf is None:
                buf = self._buffers.get(key)
                if buf is None:
                    buf = self._rebuild(bucket.handle, device_index)
                    self.opened += 1
                else:
                    self.reused += 1
            if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != bucket.nbytes:
                raise ValueError(
                    f"cuda_ipc: rebuilt buffer is {buf.dtype} {tuple(buf.shape)}, expected ({bucket.nbytes},) uint8"
                )
            kept[key] = buf
            out.append(buf)
        self._buffers = kept
        return out

    def views(self, payload: list[IpcBucket], device_index: int) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor in the payload; the views share the sender's buffers."""
        named: list[tuple[str, torch.Tensor]] = []
        views: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        for bucket, buf in zip(payload, self.open(payload, device_index)):
            key = (handle_key(bucket.handle), bucket.layout)
            bucket_views = self._views.get(key) if bucket.layout else None
            if bucket_views is None:  # slicing hundreds of views costs ms: once per buffer and layout
                bucket_views = list(unpack_bucket(WeightBucket(buffer=buf, metas=bucket.tensor_metas())))
            views[key] = bucket_views
            named.extend(bucket_views)
        self._views = views
        return named

    def clear(self) -> None:
        self._buffers = {}
        self._views = {}


# ------------------------------------------------------------------------------------ learner-side packing
class FusedPack:
    """Fills a `BucketPacker`'s buffers with one `torch._foreach_copy_` instead of one copy per tensor.

    `BucketPacker.pack` checks and copies tensor by tensor (~20 us each: ~6 ms for the 290 tensors of a 0.5B
    model, measured); the destination views never change, so they are sliced once here. Any push whose
    names, shapes or dtypes differ from the first goes through `BucketPacker.pack`, which says what differs.
    """

    def __init__(self, packer: Any, named: list[tuple[str, torch.Tensor]]) -> None:
        self.packer = packer
        self.buckets = packer.pack(named)  # the first push, checked; also gives the bucket objects to reuse
        views = dict(v for bucket in self.buckets for v in unpack_bucket(bucket))
        self.names = [n for n, _ in named]
        self.specs = [(t.shape, t.dtype) for _, t in named]
        self.views = [views[n] for n in self.names]

    @torch.no_grad()
    def pack(self, named: list[tuple[str, torch.Tensor]]) -> list[Any]:
        # per push: no tuple(shape) and no detach (no_grad instead): 0.34 ms less for 392 tensors on the CPU box
        if [n for n, _ in named] != self.names or [(t.shape, t.dtype) for _, t in named] != self.specs:
            return self.packer.pack(named)
        srcs = [t for _, t in named]
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(self.views, srcs)
        else:
            for dst, src in zip(self.views, srcs):
                dst.copy_(src)
        return self.buckets


# --------------------------------------------------------------------------------- in-place direct copies
class DirectCopyPlan:
    """Where each incoming (Hugging Face named) tensor lands inside an engine model's parameters.

    vLLM fuses some checkpoint tensors (q/k/v -> qkv_proj, gate/up -> gate_up_proj, as listed in the model's
    `packed_modules_mapping`) and may pad the vocabulary; its `load_weights` resolves that in Python, tensor
    by tensor, every push. With one device (no tensor parallelism) each incoming tensor is a row block of one
    parameter, so the plan stores that block as a view and a push becomes one `torch._foreach_copy_`.

    The plan is a guess from names and shapes, so it is only trusted after `verify` has checked, right
    after the model's own `load_weights` consumed the same tensors, that every planned view already holds
    exactly its source (and that the planned views cover every parameter). Anything unexpected (tensor
    parallel shards, quantized weights, an unknown name) makes `build` return None and the caller keeps
    using `load_weights`. Parameters must keep their storage (vLLM's sleep mode remaps the same addresses);
    `still_valid` checks the data pointers before each use.
    """

    def __init__(self, names: list[str], views: list[torch.Tensor], params: dict[str, torch.Tensor]) -> None:
        self.names = names  # incoming tensor names, in the order of `views`
        self.views = views  # destination views into the model's parameters
        self._ptrs = {n: p.data_ptr() for n, p in params.items()}
        self._params = params

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        incoming: Iterable[tuple[str, tuple[int, ...] | torch.Size, torch.dtype]],
    ) -> tuple[DirectCopyPlan | None, str]:
        """(plan, "") or (None, reason) for tensors described by (name, shape, dtype)."""
        live = dict(model.named_parameters())  # the Parameter objects, whose storage may be swapped
        params = {n: p.data for n, p in live.items()}
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        shard_of = {shard: (fused, i) for fused, shards in packed.items() for i, shard in enumerate(shards)}
        names: list[str] = []
        views: list[torch.Tensor] = []
        fused_parts: dict[str, list[tuple[int, str, tuple[int, ...], torch.dtype]]] = {}
        direct_covered: set[str] = set()
        for name, shape, dtype in incoming:
            shape = tuple(int(d) for d in shape)
            dst = params.get(name)
            if dst is not None:
                view = _leading_block(dst, 0, shape)
                if view is None:
                    return None, f"{name}: incoming {shape} does not fit parameter {tuple(dst.shape)}"
                if view.numel() != dst.numel() and not _is_row_padding(dst, shape):
                    return None, f"{name}: incoming {shape} covers part of {tuple(dst.shape)}"
                names.append(name)
                views.append(view)
                direct_covered.add(name)
                continue
            parts = name.split(".")
            target = None
            for i, part in enumerate(parts):
                if part in shard_of:
                    fused, index = shard_of[part]
                    fused_name = ".".join([*parts[:i], fused, *parts[i + 1 :]])
                    if fused_name in params:
                        target = (fused_name, index)
                        break
            if target is None:
                return None, f"{name}: no parameter of that name or fused target"
            fused_parts.setdefault(target[0], []).append((target[1], name, shape, dtype))
        fused_covered: set[str] = set()
        for fused_name, shards in fused_parts.items():
            dst = params[fused_name]
            shards.sort()
            offset = 0
            for _, name, shape, _ in shards:
                view = _leading_block(dst, offset, shape)
                if view is None:
                    return None, f"{name}: rows [{offset}, {offset + shape[0]}) do not fit {fused_name} {tuple(dst.shape)}"
                names.append(name)
                views.append(view)
                offset += shape[0]
            if offset != dst.shape[0]:
                return None, f"{fused_name}: its shards fill {offset} of {dst.shape[0]} rows (tensor parallel?)"
            fused_covered.add(fused_name)
        uncovered = sorted(set(params) - direct_covered - fused_covered)
        if uncovered:
            return None, f"{len(uncovered)} parameter(s) receive nothing, e.g. {uncovered[:3]}"
        return cls(names, views, live), ""

    def verify(self, named: Iterable[tuple[str, torch.Tensor]]) -> str:
        """"" when every planned view equals its incoming tensor, else what differs."""
        incoming = dict(named)
        if set(incoming) != set(self.names):
            return f"plan names differ from the push ({len(self.names)} planned, {len(incoming)} sent)"
        for name, view in zip(self.names, self.views):
            src = incoming[name]
            if view.dtype != src.dtype or not torch.equal(view, src.to(view.device)):
                return f"{name}: the model's load_weights wrote something else than the planned view holds"
        return ""

    def still_valid(self) -> bool:
        return all(p.data_ptr() == self._ptrs[n] for n, p in self._params.items())

    def copy(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every incoming tensor into its view; returns the count. Names must be the planned ones."""
        incoming = dict(named)
        if len(incoming) != len(self.names):
            raise ValueError(f"direct copy: {len(incoming)} tensors sent, {len(self.names)} planned")
        try:
            srcs = [incoming[n] for n in self.names]
        except KeyError as err:
            raise ValueError(f"direct copy: {err.args[0]!r} is not in the plan") from None
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(self.views, srcs)  # one launch for every tensor (falls back per dtype)
        else:
            for dst, src in zip(self.views, srcs):
                dst.copy_(src)
        return len(srcs)


def _leading_block(dst: torch.Tensor, row: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """dst[row : row + shape[0]] (with trailing dims equal), or None when it does not fit."""
    if len(shape) != dst.dim() or (dst.dim() == 0 and shape != ()):
        return None
    if dst.dim() == 0:
        return dst
    if tuple(dst.shape[1:]) != shape[1:] or row + shape[0] > dst.shape[0]:
        return None
    return dst.narrow(0, row, shape[0])


def _is_row_padding(dst: torch.Tensor, shape: tuple[int, ...]) -> bool:
    # vLLM pads vocabulary rows (embeddings, lm_head) up to a multiple of 64; the rest stays unused
    return dst.dim() >= 1 and shape[0] < dst.shape[0]


def make_transport(name: str, route: Any = None, rank: int = 0) -> WeightTransport:
    """`object_store`/`auto` -> ObjectStoreTransport, `cuda_ipc` -> CudaIpcTransport, `collective` ->
    CollectiveTransport (rlsys/weights/collective.py) on ``route`` (a `CollectiveRoute`) as group rank ``rank``
    (0: the learner).

    `auto` is resolved per engine by the route plan (rlsys/weights/routes.py `plan_routes`), which knows whether
    learner and engine share a GPU; on its own it means the transport that works everywhere.
    """
    if name in ("object_store", "auto"):
        return ObjectStoreTransport()
    if name == "cuda_ipc":
        return CudaIpcTransport()
    if name == "collective":
        return CollectiveTransport(route, rank)
    raise ValueError(f"sync.transport {name!r} is unknown; expected auto, cuda_ipc, collective or object_store")
