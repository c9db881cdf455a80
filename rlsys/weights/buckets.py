"""Bucket packing for weight sync: many named tensors in a few flat, reusable byte buffers.

A weight push moves hundreds of tensors; one IPC handle / RPC per tensor is slow (OpenRLHF's habit,
see STYLE.md), so the learner packs them into buckets of ~512 MiB and ships one handle per bucket.
The receiver rebuilds each bucket's buffer and slices zero-copy views with ``unpack_bucket``.

- ``plan_buckets`` lays tensors out greedily in the given order, each at a 256-byte-aligned offset
  (enough for any dtype's ``view`` and for coalesced copies); a tensor bigger than the bucket size
  gets a bucket of its own.
- ``BucketPacker`` allocates its buffers once and refills them on every ``pack``: the CUDA IPC path
  hands out handles to the same storage every push, so the receiver-side mapping can be cached and
  memory use stays flat. Every push must carry exactly the planned names, shapes and dtypes.
- Packing may cast floating tensors to a target dtype (e.g. fp32 master weights -> bf16 for vLLM);
  integer and bool tensors are never cast. Without a cast the round trip is bit-for-bit.

Torch only (no Ray, no CUDA-specific calls): it is used by every transport.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN_BYTES = 256
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # 512 MiB


def _align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * torch.empty((), dtype=dtype).element_size()


@dataclass
class TensorMeta:
    """Where one tensor lives inside a bucket buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer
    nbytes: int  # numel * element_size

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        expected = _nbytes(self.shape, self.dtype)
        if self.nbytes != expected:
            raise ValueError(f"TensorMeta {self.name}: nbytes {self.nbytes} != {expected} for {self.shape} {self.dtype}")
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if self.offset < 0 or self.offset % itemsize:
            raise ValueError(f"TensorMeta {self.name}: offset {self.offset} not a multiple of itemsize {itemsize}")

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class WeightBucket:
    """A flat byte buffer and the tensors laid out in it; what one transport message carries."""

    buffer: torch.Tensor  # (N,) uint8, contiguous
    metas: list[TensorMeta]

    def __post_init__(self) -> None:
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 or not self.buffer.is_contiguous():
            raise ValueError(
                f"WeightBucket: buffer must be a flat contiguous uint8 tensor, got "
                f"{self.buffer.dtype} {tuple(self.buffer.shape)}"
            )
        size = self.buffer.numel()
        prev_end, prev_name = 0, None
        for m in sorted(self.metas, key=lambda m: m.offset):
            if m.end > size:
                raise ValueError(f"WeightBucket: {m.name} spans bytes [{m.offset}, {m.end}) past buffer size {size}")
            if m.offset < prev_end:
                raise ValueError(f"WeightBucket: {m.name} at byte {m.offset} overlaps {prev_name} (ends {prev_end})")
            prev_end, prev_name = max(prev_end, m.end), m.name

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def plan_buckets(
    named_shapes_dtypes: Iterable[tuple[str, tuple[int, ...] | torch.Size, torch.dtype]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> list[list[TensorMeta]]:
    """Greedy, order-preserving layout of tensors into buckets of at most ``bucket_bytes``.

    Each tensor starts at a 256-byte-aligned offset. A tensor larger than ``bucket_bytes`` gets a
    bucket of its own (the only case where a bucket exceeds the limit). Names must be unique.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    plan: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    cursor = 0  # bytes used in the current bucket
    seen: set[str] = set()
    for name, shape, dtype in named_shapes_dtypes:
        if name in seen:
            raise ValueError(f"plan_buckets: duplicate tensor name {name!r}")
        seen.add(name)
        shape = tuple(int(d) for d in shape)
        nbytes = _nbytes(shape, dtype)
        offset = _align_up(cursor)
        if current and offset + nbytes > bucket_bytes:
            plan.append(current)
            current, offset = [], 0
        current.append(TensorMeta(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        cursor = offset + nbytes
        if nbytes > bucket_bytes:  # oversize: alone in its bucket, close it now
            plan.append(current)
            current, cursor = [], 0
    if current:
        plan.append(current)
    return plan


def bucket_size(metas: list[TensorMeta]) -> int:
    """Bytes a buffer needs to hold ``metas``."""
    return max((m.end for m in metas), default=0)


def _view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    # (nbytes,) uint8 -> (numel,) dtype -> shape; all views of the same storage
    return buffer[meta.offset : meta.end].view(meta.dtype).view(meta.shape)


class BucketPacker:
    """Packs a fixed set of named tensors into buffers allocated once, refilled on every ``pack``.

    ``named_shapes_dtypes`` describes the tensors as the caller will pass them (source dtypes);
    with ``dtype`` set, floating tensors are stored (and unpacked) in that dtype instead.
    """

    def __init__(
        self,
        named_shapes_dtypes: Iterable[tuple[str, tuple[int, ...] | torch.Size, torch.dtype]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        specs = [(name, tuple(int(d) for d in shape), src_dtype) for name, shape, src_dtype in named_shapes_dtypes]
        self.source_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {n: (s, d) for n, s, d in specs}
        self.cast_dtype = dtype
        self.plan = plan_buckets(
            ((n, s, self._stored_dtype(d)) for n, s, d in specs), bucket_bytes=bucket_bytes
        )
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor] = [
            torch.empty(bucket_size(metas), dtype=torch.uint8, device=self.device) for metas in self.plan
        ]  # each (N_b,) uint8, reused by every pack()
        self._where: dict[str, tuple[int, TensorMeta]] = {
            m.name: (b, m) for b, metas in enumerate(self.plan) for m in metas
        }

    @classmethod
    def for_tensors(
        cls, named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs
    ) -> BucketPacker:
        """A packer planned from example tensors (their names, shapes and dtypes)."""
        return cls(((n, tuple(t.shape), t.dtype) for n, t in named_tensors), **kwargs)

    def _stored_dtype(self, src: torch.dtype) -> torch.dtype:
        if self.cast_dtype is not None and src.is_floating_point:
            return self.cast_dtype
        return src

    @property
    def total_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightBucket]:
        """Copy every planned tensor into its slot; the returned buckets share this packer's buffers.

        Raises ValueError naming the tensor when a name is unknown, repeated or missing, or its shape or
        dtype differs from the plan. A later ``pack`` overwrites the buffers: consume the buckets first.
        """
        filled: set[str] = set()
        for name, tensor in named_tensors:
            if name not in self._where:
                raise ValueError(f"BucketPacker.pack: {name!r} is not in the plan")
            if name in filled:
                raise ValueError(f"BucketPacker.pack: {name!r} given twice")
            shape, src_dtype = self.source_specs[name]
            if tuple(tensor.shape) != shape or tensor.dtype != src_dtype:
                raise ValueError(
                    f"BucketPacker.pack: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the plan expects {shape} {src_dtype}"
                )
            b, meta = self._where[name]
            # copy_ handles non-contiguous sources, device transfer and the optional cast
            _view(self.buffers[b], meta).copy_(tensor.detach())
            filled.add(name)
        missing = [n for n in self._where if n not in filled]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"BucketPacker.pack: {len(missing)} planned tensor(s) not given: {shown}")
        return [WeightBucket(buffer=buf, metas=list(metas)) for buf, metas in zip(self.buffers, self.plan)]


def unpack_bucket(bucket: WeightBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, view) for each tensor in the bucket; views share the bucket's buffer (no copies)."""
    for meta in bucket.metas:
        yield meta.name, _view(bucket.buffer, meta)
