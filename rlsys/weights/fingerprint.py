"""Exact fingerprints of pushed weights: the cheap per-push check that a push landed (`WeightSync.check_canary`).

The canary compares logprobs, so it needs a forward on both sides (~60 ms a step for Qwen 0.5B on an H200, more
than the 20-30 ms push it checks) and a tolerance wide enough for the numerics gap, which with fp32 masters or
LoRA is wider than one step's change. A fingerprint compares bits instead: for each pushed tensor, the sum of its
bytes read as 32-bit words, modulo 2**32 (a tensor whose size is not a multiple of 4 bytes: of its elements' bit
patterns, bf16 as int16, modulo 2**32 too). Integer addition modulo 2**32 is exact and order-free, so the sender's
sum over what it packed equals the receiver's over what it holds whatever kernels, layout or reduction order either
side uses, and a change of one element changes it (the change of one word is never a multiple of 2**32).

Why 32-bit words summed in int32 (wrapping): it reads each byte once without a widening cast. On an H200 the 290
tensors of a Qwen 0.5B push took 5.6 ms as int16 elements summed in int64 and 2.7 ms as int32 words, and 0.95 ms
as words of one flat buffer (docs/performance.md, issue 24 item 4; scripts/fingerprint_bench.py). So the learner,
whose buckets are flat buffers with every tensor at a 256-byte offset, sums each bucket in three kernels (64-word
row sums, their running sum, one gather at the tensors' bounds); an engine sums its separate parameters one
reduction each. One device-to-host transfer per device in all.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rlsys.weights.buckets import ALIGN_BYTES, TensorMeta, WeightBucket

_WORD = 4
_ROW_WORDS = ALIGN_BYTES // _WORD  # a bucket's tensors start on a row: 64 words of 4 bytes
_ELEMENT_BITS = {1: torch.int8, 2: torch.int16}
_MASK = (1 << 32) - 1


def _integers(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat integer tensor: 32-bit words when its size is a multiple of 4 bytes, else its
    elements' bit patterns (what both sides of a push agree on: the choice depends on the size alone). A view of
    the tensor's storage, except for a non-contiguous tensor or 32-bit words starting mid-word (a copy)."""
    t = tensor.detach().reshape(-1)
    nbytes = t.numel() * t.element_size()
    if nbytes % _WORD:
        return t.view(_ELEMENT_BITS[t.element_size()])  # 1- or 2-byte elements: an odd count of them
    if (t.storage_offset() * t.element_size()) % _WORD:  # a view starting mid-word: `view` needs whole words
        t = t.clone()
    return t.view(torch.uint8).view(torch.int32)


def _to_host(parts: list[tuple[list[str], torch.Tensor]]) -> dict[str, int]:
    """{name: sum modulo 2**32} from (names, one int32 sum per name) parts, one transfer per device."""
    by_device: dict[torch.device, list[tuple[list[str], torch.Tensor]]] = {}
    for names, sums in parts:
        by_device.setdefault(sums.device, []).append((names, sums.reshape(-1)))
    out: dict[str, int] = {}
    for group in by_device.values():
        names = [name for part_names, _ in group for name in part_names]
        out.update(zip(names, (int(v) & _MASK for v in torch.cat([s for _, s in group]).tolist())))
    return out


def tensor_sums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: the tensor's bytes summed as 32-bit words, modulo 2**32} (see the module docstring)."""
    return _to_host([([name], _integers(tensor).sum(dtype=torch.int32)) for name, tensor in named])


class WordSums:
    """`tensor_sums` of tensors whose storage stays put (an engine's weights between pushes), their integer views
    made once: each call is then one reduction per tensor, one stack and one transfer. On an H200, 290 tensors of
    Qwen 0.5B took 4.9 ms through `tensor_sums` (views made every call), and the same reductions on views made
    once 3.0 ms (docs/performance.md). The sums are read at call time: a push into the same storage changes them."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.names: list[str] = []
        self._parts: list[tuple[torch.Tensor, bool]] = []  # (integer view, True) or (the tensor itself, False)
        for name, tensor in named:
            words = _integers(tensor)
            view = words.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            self.names.append(name)
            self._parts.append((words, True) if view else (tensor, False))  # a copy is taken again at each call

    def __call__(self) -> dict[str, int]:
        if not self.names:
            return {}
        sums = [(w if view else _integers(w)).sum(dtype=torch.int32) for w, view in self._parts]
        return _to_host([(self.names, torch.stack(sums))])


def _row_plan(bucket: WeightBucket) -> tuple[list[str], torch.Tensor | None, list[TensorMeta]]:
    """How `_bucket_parts` sums a bucket: the names of its tensors on whole 256-byte rows with their (start, end)
    rows on the buffer's device, and the other tensors' metas."""
    rows = bucket.buffer.numel() // ALIGN_BYTES
    whole, rest = [], []
    for m in bucket.metas:
        on_rows = rows and m.offset % ALIGN_BYTES == 0 and m.nbytes % ALIGN_BYTES == 0
        (whole if on_rows else rest).append(m)
    bounds = (torch.tensor([[m.offset // ALIGN_BYTES, m.end // ALIGN_BYTES] for m in whole],
                           device=bucket.buffer.device) if whole else None)
    return [m.name for m in whole], bounds, rest


def _bucket_parts(bucket: WeightBucket, plan: tuple | None = None) -> list[tuple[list[str], torch.Tensor]]:
    """The sums of a bucket's tensors: those of whole 256-byte rows in three kernels over its buffer (64-word row
    sums, their running sum, a gather at the tensors' bounds), any other one reduction each. ``plan``: the bucket's
    `_row_plan`, when kept from an earlier call."""
    names, bounds, rest = plan or _row_plan(bucket)
    parts = []
    if names:
        rows = bucket.buffer.numel() // ALIGN_BYTES
        words = bucket.buffer[: rows * ALIGN_BYTES].view(torch.int32).view(rows, _ROW_WORDS)
        running = torch.zeros(rows + 1, dtype=torch.int32, device=words.device)
        torch.cumsum(words.sum(1, dtype=torch.int32), 0, dtype=torch.int32, out=running[1:])
        parts.append((names, running[bounds[:, 1]] - running[bounds[:, 0]]))
    for m in rest:
        tensor = bucket.buffer[m.offset : m.end].view(m.dtype)
        parts.append(([m.name], _integers(tensor).sum(dtype=torch.int32)))
    return parts


def bucket_sums(buckets: Iterable[WeightBucket]) -> dict[str, int]:
    """`tensor_sums` of every tensor packed in ``buckets``: what a sender fingerprints, the very bytes it sent."""
    return _to_host([part for bucket in buckets for part in _bucket_parts(bucket)])


class BucketSums:
    """`bucket_sums` of buckets refilled in place (a sender's reused buffers, a receiver's regrouped views): each
    bucket's row plan (`_row_plan`: its names and their row bounds, on the device) is made once and kept while a call
    brings the same bucket objects; the sums are read at call time."""

    def __init__(self) -> None:
        self._buckets: list[WeightBucket] = []
        self._plans: list[tuple] = []

    def __call__(self, buckets: Iterable[WeightBucket]) -> dict[str, int]:
        return _to_host(self.parts(buckets))

    def parts(self, buckets: Iterable[WeightBucket]) -> list[tuple[list[str], torch.Tensor]]:
        buckets = list(buckets)
        if len(buckets) != len(self._buckets) or any(a is not b for a, b in zip(buckets, self._buckets)):
            self._buckets, self._plans = buckets, [_row_plan(bucket) for bucket in buckets]
        return [part for bucket, plan in zip(self._buckets, self._plans) for part in _bucket_parts(bucket, plan)]


class ViewSums:
    """`tensor_sums` of views into a few flat buffers (what a receiver unpacked from the buckets it was sent): the
    views are regrouped into the buffers they slice, each summed as `bucket_sums` sums a bucket, three kernels for
    its views on whole 256-byte rows instead of one reduction per view (392 of them for a 7B model's r=16 adapter).
    A non-contiguous view, or views of one buffer that overlap, are summed one reduction each.

    The regrouping is kept while a call brings the same view objects under the same names (a CUDA IPC receiver hands
    out the views it sliced once; holding them pins their storage, so the same objects are the same bytes); the
    sums are read at call time."""

    def __init__(self) -> None:
        self._named: list[tuple[str, torch.Tensor]] = []
        self._buckets: list[WeightBucket] = []
        self._rest: list[tuple[str, torch.Tensor]] = []
        self._sums = BucketSums()

    def __call__(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
        named = list(named)
        if len(named) != len(self._named) or any(
                n is not m and n != m or t is not u for (n, t), (m, u) in zip(named, self._named)):
            self._named = named
            self._buckets, self._rest = _regroup(named)
        parts = self._sums.parts(self._buckets)
        parts += [([name], _integers(tensor).sum(dtype=torch.int32)) for name, tensor in self._rest]
        return _to_host(parts)


def _regroup(named: list[tuple[str, torch.Tensor]]) -> tuple[list[WeightBucket], list[tuple[str, torch.Tensor]]]:
    """The contiguous views of ``named`` as buckets over their storages (a flat uint8 tensor each, a meta per view),
    and the views left out of them."""
    groups: dict[tuple[torch.device, int], tuple[torch.UntypedStorage, list[TensorMeta]]] = {}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if not tensor.is_contiguous():
            rest.append((name, tensor))
            continue
        storage = tensor.untyped_storage()
        size = tensor.element_size()
        meta = TensorMeta(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape),
                          offset=tensor.storage_offset() * size, nbytes=tensor.numel() * size)
        groups.setdefault((tensor.device, storage.data_ptr()), (storage, []))[1].append(meta)
    buckets = []
    for storage, metas in groups.values():
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        try:
            buckets.append(WeightBucket(buffer=flat, metas=metas))
        except ValueError:  # overlapping views: each on its own
            rest += [(m.name, flat[m.offset : m.end].view(m.dtype).view(m.shape)) for m in metas]
    return buckets, rest


def differing(reference: dict[str, int], held: dict[str, int]) -> list[str]:
    """Names whose sums differ between what was sent (``reference``) and what a receiver holds, sorted; a name the
    receiver lacks counts as differing, one it has beyond the reference does not (tied or unpushed weights)."""
    return sorted(name for name, value in reference.items() if held.get(name) != value)
