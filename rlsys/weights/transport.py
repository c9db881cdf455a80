"""Weight transports: how packed buckets travel from the learner to the engine.

All transports share one shape: the learner side turns its buckets into a payload (`export`), Ray carries
the payload to the rollout actor, and the engine side turns it back into named tensors (`receive`). The
driver never branches on which one is used (NeMo-RL's `sync_weights()` habit).

- `object_store`: the buckets themselves (CPU tensors), copied through Ray's object store. CPU runs,
  and learner and engine on different nodes.
- `cuda_ipc`: one CUDA IPC handle per bucket (same GPU); added with the vLLM engine.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from rlsys.weights.buckets import WeightBucket, unpack_bucket


class ObjectStoreTransport:
    name = "object_store"

    def export(self, buckets: list[WeightBucket]) -> list[WeightBucket]:
        # the packer refills its buffers on the next push: hand out copies, never its own storage
        return [WeightBucket(buffer=b.buffer.to("cpu", copy=True), metas=b.metas) for b in buckets]

    def receive(self, payload: list[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in payload:
            yield from unpack_bucket(bucket)


def make_transport(name: str) -> ObjectStoreTransport:
    if name in ("object_store", "auto"):
        return ObjectStoreTransport()
    raise ValueError(f"sync.transport {name!r} is not available here (object_store only without CUDA)")
