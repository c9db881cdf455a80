"""Exact fingerprints of pushed weights: the cheap per-push check that a push landed (`WeightSync.check_canary`).

The canary compares logprobs, so it needs a forward on both sides (~60 ms a step for Qwen 0.5B on an H200, more
than the 20-30 ms push it checks) and a tolerance wide enough for the numerics gap, which with fp32 masters or
LoRA is wider than one step's change. A fingerprint compares bits instead: for each pushed tensor, the sum of its
elements' bit patterns as integers (bf16 as int16, float32 as int32, summed in int64). Integer addition is exact
and order-free, so the sender's sum over what it packed equals the receiver's sum over what it holds whatever
kernels either side uses, and any changed element changes it. The learner sums its packed buckets (the exact bytes
sent); an engine sums the parameters the push wrote (or, where it merges LoRA adapters, the adapters it merged).
One reduction per tensor and one device sync in all.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rlsys.weights.buckets import WeightBucket, unpack_bucket

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_sums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: sum of the tensor's element bit patterns} (exact integers; int64 wraps alike on every side)."""
    names, sums = [], []
    for name, tensor in named:
        t = tensor.detach()
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t = t.contiguous().view(_BITS[t.element_size()])
        sums.append(t.sum(dtype=torch.int64).reshape(1))
        names.append(name)
    if not sums:
        return {}
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    values: list[int] = [0] * len(sums)
    for idx in by_device.values():  # one transfer (and sync) per device
        for i, v in zip(idx, torch.cat([sums[i] for i in idx]).tolist()):
            values[i] = int(v)
    return dict(zip(names, values))


def bucket_sums(buckets: Iterable[WeightBucket]) -> dict[str, int]:
    """`tensor_sums` of every tensor packed in ``buckets``: what a sender fingerprints, the very bytes it sent."""
    return tensor_sums(pair for bucket in buckets for pair in unpack_bucket(bucket))


def differing(reference: dict[str, int], held: dict[str, int]) -> list[str]:
    """Names whose sums differ between what was sent (``reference``) and what a receiver holds, sorted; a name the
    receiver lacks counts as differing, one it has beyond the reference does not (tied or unpushed weights)."""
    return sorted(name for name, value in reference.items() if held.get(name) != value)
