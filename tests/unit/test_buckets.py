"""Bucket packing for weight sync: layout, bit-exact round trips, buffer reuse, plan checks."""
from __future__ import annotations

import pytest
import torch

from rlsys.weights.buckets import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    BucketPacker,
    TensorMeta,
    WeightBucket,
    plan_buckets,
    unpack_bucket,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(7, 5, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = float("nan"), float("-inf"), -0.0
    return [
        ("f32", f32),
        ("bf16", torch.randn(3, 11, generator=g).to(torch.bfloat16)),
        ("fp16", torch.randn(13, generator=g).to(torch.float16)),
        ("i64", torch.randint(-(2**40), 2**40, (4, 3), generator=g)),
        ("bool", torch.rand(9, generator=g) > 0.5),
        ("noncontig", torch.randn(6, 4, generator=g).t()),  # (4, 6) transposed view
        ("strided", torch.randn(10, generator=g)[::3]),  # (4,) stride 3
        ("scalar", torch.tensor(3.25)),  # 0-d
        ("empty", torch.empty(0, 5)),  # zero numel
        ("u8", torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8)),
    ]


def test_default_bucket_size_is_512_mib():
    assert DEFAULT_BUCKET_BYTES == 512 * 1024 * 1024


def test_plan_aligns_offsets_and_keeps_order():
    specs = [("a", (3,), torch.float32), ("b", (1,), torch.bool), ("c", (5, 2), torch.float16)]
    (metas,) = plan_buckets(specs, bucket_bytes=4096)
    assert [m.name for m in metas] == ["a", "b", "c"]
    assert [m.offset for m in metas] == [0, ALIGN_BYTES, 2 * ALIGN_BYTES]
    assert [m.nbytes for m in metas] == [12, 1, 20]


def test_plan_splits_greedily_at_bucket_size():
    # each tensor 400 B -> slots at 0, 512 (aligned); a third would end at 1424 > 1024
    specs = [(f"t{i}", (100,), torch.float32) for i in range(5)]
    plan = plan_buckets(specs, bucket_bytes=1024)
    assert [[m.name for m in b] for b in plan] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert all(b[0].offset == 0 for b in plan)
    assert all(m.end <= 1024 for b in plan for m in b)


def test_oversize_tensor_gets_its_own_bucket():
    specs = [("small", (10,), torch.float32), ("big", (1000,), torch.float32), ("after", (10,), torch.float32)]
    plan = plan_buckets(specs, bucket_bytes=1024)
    assert [[m.name for m in b] for b in plan] == [["small"], ["big"], ["after"]]
    assert plan[1][0].offset == 0 and plan[1][0].nbytes == 4000


def test_plan_rejects_duplicate_names_and_bad_size():
    with pytest.raises(ValueError, match="duplicate"):
        plan_buckets([("a", (1,), torch.float32), ("a", (2,), torch.float32)])
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (1,), torch.float32)], bucket_bytes=0)


@pytest.mark.parametrize("bucket_bytes", [64, 1024, DEFAULT_BUCKET_BYTES])
def test_round_trip_is_bit_exact(bucket_bytes):
    tensors = _mixed_tensors()
    packer = BucketPacker.for_tensors(tensors, bucket_bytes=bucket_bytes)
    buckets = packer.pack(tensors)
    out = {name: t for b in buckets for name, t in unpack_bucket(b)}
    assert list(out) == [n for n, _ in tensors]
    for name, src in tensors:
        got = out[name]
        assert got.dtype == src.dtype and got.shape == src.shape, name
        assert torch.equal(_bits(got), _bits(src)), name


def test_unpack_yields_views_of_the_buffer():
    tensors = _mixed_tensors()
    (bucket,) = BucketPacker.for_tensors(tensors).pack(tensors)
    start = bucket.buffer.data_ptr()
    for (name, view), meta in zip(unpack_bucket(bucket), bucket.metas):
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr(), name
        if view.numel():
            assert view.data_ptr() == start + meta.offset, name
            assert view.data_ptr() % ALIGN_BYTES == start % ALIGN_BYTES, name
    # writing through a view changes the buffer: no copy was made
    _, f32 = next(unpack_bucket(bucket))
    f32[1, 1] = 123.0
    assert dict(unpack_bucket(bucket))["f32"][1, 1].item() == 123.0


def test_buffers_are_allocated_once_and_refilled():
    g = torch.Generator().manual_seed(1)
    first = [("w", torch.randn(50, 3, generator=g)), ("b", torch.randn(50, generator=g))]
    packer = BucketPacker.for_tensors(first, bucket_bytes=512)
    ptrs = [b.buffer.data_ptr() for b in packer.pack(first)]
    second = [(n, t + 1.0) for n, t in first]
    buckets = packer.pack(second)
    assert [b.buffer.data_ptr() for b in buckets] == ptrs
    out = {n: t for b in buckets for n, t in unpack_bucket(b)}
    for name, src in second:
        assert torch.equal(out[name], src), name


def test_pack_accepts_any_order_and_casts_floats_only():
    tensors = [("w", torch.randn(4, 4)), ("step", torch.tensor([7, 8])), ("flag", torch.tensor([True, False]))]
    packer = BucketPacker.for_tensors(tensors, dtype=torch.bfloat16)
    buckets = packer.pack(reversed(tensors))
    out = {n: t for b in buckets for n, t in unpack_bucket(b)}
    assert out["w"].dtype == torch.bfloat16
    assert torch.equal(out["w"], tensors[0][1].to(torch.bfloat16))
    assert out["step"].dtype == torch.int64 and torch.equal(out["step"], tensors[1][1])
    assert out["flag"].dtype == torch.bool and torch.equal(out["flag"], tensors[2][1])
    assert packer.total_bytes < 4 * 4 * 4 + 2 * ALIGN_BYTES + 16


@pytest.mark.parametrize(
    "bad, match",
    [
        ([("w", torch.zeros(2, 3)), ("extra", torch.zeros(1))], "not in the plan"),
        ([("w", torch.zeros(3, 2)), ("b", torch.zeros(3))], "plan expects"),
        ([("w", torch.zeros(2, 3, dtype=torch.float64)), ("b", torch.zeros(3))], "plan expects"),
        ([("w", torch.zeros(2, 3))], "not given: b"),
        ([("w", torch.zeros(2, 3)), ("w", torch.zeros(2, 3))], "given twice"),
    ],
)
def test_pack_rejects_tensors_that_do_not_match_the_plan(bad, match):
    packer = BucketPacker([("w", (2, 3), torch.float32), ("b", (3,), torch.float32)])
    with pytest.raises(ValueError, match=match):
        packer.pack(bad)


def test_records_check_themselves():
    with pytest.raises(ValueError, match="nbytes"):
        TensorMeta("x", torch.float32, (2,), 0, 7)
    with pytest.raises(ValueError, match="offset"):
        TensorMeta("x", torch.float32, (2,), 2, 8)
    meta = TensorMeta("x", torch.float32, (4,), 256, 16)
    with pytest.raises(ValueError, match="past buffer size"):
        WeightBucket(torch.empty(260, dtype=torch.uint8), [meta])
    with pytest.raises(ValueError, match="uint8"):
        WeightBucket(torch.empty(272, dtype=torch.float32), [meta])
    with pytest.raises(ValueError, match="overlaps"):
        WeightBucket(torch.empty(512, dtype=torch.uint8), [meta, TensorMeta("y", torch.float32, (2,), 264, 8)])
    WeightBucket(torch.empty(272, dtype=torch.uint8), [meta])
