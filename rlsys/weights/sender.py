"""A learner rank's side of a weight push: its tensors packed into reusable buckets and handed to each transport.

The buckets are allocated on the first export (`BucketPacker`, checked tensor by tensor) and refilled by one fused
copy afterwards (`FusedPack`); each opened transport turns them into its payload (CUDA IPC handles made once per
buffer, a collective's broadcast, the object store's bytes). The fingerprint of what was sent is taken from the
same buckets (`BucketSums`, their row plans made once).
"""
from __future__ import annotations

from typing import Any

import torch

from rlsys.weights.buckets import DEFAULT_BUCKET_BYTES, BucketPacker, WeightBucket
from rlsys.weights.fingerprint import BucketSums


class BucketSender:
    """``cast``: the dtype the buckets hold (the engine's, when the learner trains fp32 masters or LoRA's float32
    adapters: the receiver then casts nothing), None to keep each tensor's own."""

    def __init__(self, device: torch.device, cast: torch.dtype | None = None) -> None:
        self.device = device
        self.cast = cast
        self.transports: list[Any] = []  # the WeightTransports this rank exports by (`open`)
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.packer: BucketPacker | None = None  # made by the first export
        self._fused = None  # FusedPack over the packer, made by the first export
        self._exported: list[WeightBucket] = []  # the buckets of the last export, for `send` and `fingerprint`
        self._sums = BucketSums()

    def open(self, transports: list[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """The transports to export by, kept for the sender's lifetime; ``bucket_bytes``: the buckets' size (read by
        the first export)."""
        self.transports = list(transports)
        self.bucket_bytes = bucket_bytes

    @torch.no_grad()
    def export(self, named: list[tuple[str, torch.Tensor]]) -> Any:
        """``named`` packed into the buckets, turned into each transport's payload: a tuple of them in `open` order,
        or the payload itself when there is one transport."""
        from rlsys.weights.transport import FusedPack  # noqa: PLC0415

        if not self.transports:
            raise RuntimeError("export_weights: no transport opened; call open_transports first")
        if self._fused is None:
            self.packer = BucketPacker.for_tensors(named, bucket_bytes=self.bucket_bytes, device=self.device,
                                                   dtype=self.cast)
            self._fused = FusedPack(self.packer, named)  # packs the first push itself
            buckets = self._fused.buckets
        else:
            buckets = self._fused.pack(named)  # one fused copy into the reused buffers
        self._exported = buckets
        payloads = [transport.export(buckets) for transport in self.transports]
        return payloads[0] if len(payloads) == 1 else tuple(payloads)

    @torch.no_grad()
    def send(self) -> None:
        """After `export`, while the engines load: what the transports send beside their payloads (the collective's
        broadcasts; nothing for the others)."""
        for transport in self.transports:
            transport.send(self._exported)

    @torch.no_grad()
    def fingerprint(self) -> dict[str, int] | None:
        """{tensor name: exact sum of its bits} over the buckets of the last export, the very bytes the engines were
        sent (rlsys/weights/fingerprint.py); None before the first export."""
        return self._sums(self._exported) if self._exported else None
