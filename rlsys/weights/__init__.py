"""Weight sync from the learner to the rollout engines.

``buckets`` packs named tensors into a few reusable flat buffers (one transport message each);
transports (CUDA IPC on one GPU, NCCL/gloo broadcasts between devices in ``collective``, the Ray object
store elsewhere) and the canary check live in their own modules and are imported by name, so this package stays importable without Ray or vLLM.
"""
from rlsys.weights.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketPacker,
    TensorMeta,
    WeightBucket,
    plan_buckets,
    unpack_bucket,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketPacker",
    "TensorMeta",
    "WeightBucket",
    "plan_buckets",
    "unpack_bucket",
]
