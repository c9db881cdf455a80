"""rlsys/weights/fingerprint.py: exact bit sums that both sides of a push compute alike, and that any changed
element changes."""
from __future__ import annotations

import torch

from rlsys.weights.buckets import BucketPacker
from rlsys.weights.fingerprint import bucket_sums, differing, tensor_sums


def test_the_sums_of_what_was_packed_equal_the_sums_of_where_it_landed():
    torch.manual_seed(0)
    master = {"w": torch.randn(64, 32), "b": torch.randn(32), "steps": torch.arange(5)}  # fp32 masters, an int
    named = list(master.items())
    packer = BucketPacker.for_tensors(named, bucket_bytes=4096, dtype=torch.bfloat16)  # cast as a bf16 engine gets
    sent = bucket_sums(packer.pack(named))
    engine = {"w": torch.zeros(128, 32, dtype=torch.bfloat16), "b": torch.zeros(32, dtype=torch.bfloat16),
              "steps": torch.zeros(5, dtype=torch.long)}
    views = {"w": engine["w"][32:96], "b": engine["b"], "steps": engine["steps"]}  # a row block of a fused weight
    for name, tensor in named:
        views[name].copy_(tensor)
    assert tensor_sums(views.items()) == sent  # summed in another order and layout: the same integers
    assert differing(sent, tensor_sums(views.items())) == []


def test_one_changed_element_or_a_missing_tensor_shows():
    torch.manual_seed(1)
    weights = {"a": torch.randn(1000, dtype=torch.bfloat16), "b": torch.randn(10, 10)}
    ref = tensor_sums(weights.items())
    nudged = weights["a"].clone()
    nudged[123] = torch.nextafter(nudged[123].float(), torch.tensor(10.0)).bfloat16()  # the next bf16 value up
    if torch.equal(nudged, weights["a"]):
        nudged[123] += 1
    assert differing(ref, tensor_sums([("a", nudged), ("b", weights["b"])])) == ["a"]
    assert differing(ref, {"b": ref["b"], "extra": 1}) == ["a"]  # lost "a"; extra names do not count
    assert tensor_sums([]) == {}


def test_a_lora_merge_fingerprints_the_adapters_it_merged():
    from rlsys.lora import LoraMerge

    weight = torch.zeros(4, 6)
    merge = LoraMerge(2.0, lambda module: (weight, weight))
    assert merge.last_sums is None  # nothing merged yet: the canary checks instead
    a, b = torch.randn(2, 6), torch.randn(4, 2)
    merge.apply([("layer.lora_A", a), ("layer.lora_B", b)])
    assert merge.last_sums == tensor_sums([("layer.lora_A", a), ("layer.lora_B", b)])
    torch.testing.assert_close(weight, 2.0 * b @ a)


def _reference(tensor: torch.Tensor) -> int:
    """The sum of the tensor's bytes as little-endian 32-bit words (or, for a size that is not a multiple of 4,
    of its elements' signed bit patterns), modulo 2**32, in Python integers."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).tolist()
    width = 4 if len(raw) % 4 == 0 else tensor.element_size()
    words = [int.from_bytes(bytes(raw[i : i + width]), "little", signed=True) for i in range(0, len(raw), width)]
    return sum(words) % 2**32


def test_the_sums_are_the_words_modulo_2_32_in_every_layout_and_bucket_shape():
    torch.manual_seed(2)
    tensors = {
        "rows": torch.randn(8, 64, dtype=torch.bfloat16),  # 1024 bytes: whole 256-byte rows of a bucket
        "part_row": torch.randn(3, 10, dtype=torch.bfloat16),  # 60 bytes: words, not whole rows
        "odd": torch.randn(7, dtype=torch.bfloat16),  # 14 bytes: int16 elements
        "big": torch.full((1000,), 2**30, dtype=torch.int32),  # wraps modulo 2**32 many times
        "steps": torch.arange(5),
        "flags": torch.tensor([True, False, True]),
        "fp32": torch.randn(130),
    }
    expected = {name: _reference(t) for name, t in tensors.items()}
    assert tensor_sums(tensors.items()) == expected
    for bucket_bytes in (256, 1024, 4096, 1 << 20):  # one tensor per bucket up to all in one
        packer = BucketPacker.for_tensors(list(tensors.items()), bucket_bytes=bucket_bytes)
        assert bucket_sums(packer.pack(list(tensors.items()))) == expected, bucket_bytes
    base = torch.randn(11, dtype=torch.bfloat16)
    mid_word = base[1:9]  # starts half-way into a 32-bit word: summed from a copy, the same words
    assert tensor_sums([("v", mid_word)]) == {"v": _reference(mid_word.clone())}


def test_a_changed_element_in_a_bucket_changes_its_tensor_only():
    torch.manual_seed(3)
    named = [("a", torch.randn(16, 32, dtype=torch.bfloat16)), ("b", torch.randn(16, 32, dtype=torch.bfloat16))]
    packer = BucketPacker.for_tensors(named, bucket_bytes=1 << 20)
    sent = bucket_sums(packer.pack(named))
    named[1][1][5, 7] = -named[1][1][5, 7] if named[1][1][5, 7] != 0 else 1.0
    assert differing(sent, bucket_sums(packer.pack(named))) == ["b"]


def test_word_sums_made_once_follow_writes_into_the_same_storage():
    """`WordSums` (an engine's fingerprint, views made once): the same integers as `tensor_sums`, read at each call,
    for plain, mid-word, odd-sized and non-contiguous tensors, so a later write into the weights changes them."""
    from rlsys.weights.fingerprint import WordSums

    torch.manual_seed(2)
    fused = torch.randn(9, 6, dtype=torch.bfloat16)  # a fused weight whose row blocks are the pushed tensors
    base = torch.randn(40, dtype=torch.bfloat16)
    named = [("q", fused[0:4]), ("k", fused[4:6]), ("odd", base[1:8]),  # 7 bf16: elements, starting mid-word
             ("mid", base[1:9]), ("t", fused[:, :4].t()), ("i", torch.arange(6))]  # mid-word words; non-contiguous
    sums = WordSums(named)
    assert sums.names == [n for n, _ in named]
    before = sums()
    assert before == tensor_sums(named) == {n: _reference(t) for n, t in named}
    fused[5, 2] += 1.0  # a push into the storage (row 5 is k, and a column the transposed view holds)
    base[4] = -base[4]  # inside "odd" and "mid" (which the views made once must not have copied)
    after = sums()
    assert after == tensor_sums(named) == {n: _reference(t) for n, t in named}
    assert differing(before, after) == ["k", "mid", "odd", "t"]  # the writes show in the tensors that hold them
    assert WordSums([])() == {}


def test_view_sums_regroup_a_receivers_views_into_their_buckets():
    """`ViewSums` (a LoRA receiver's fingerprint of what it was sent): the views of received buckets summed per
    buffer give `tensor_sums`' integers, with views outside any bucket (a transposed one, two that overlap, a plain
    tensor) beside them; the regrouping is kept for the same view objects and made again for new ones."""
    from rlsys.weights.buckets import unpack_bucket
    from rlsys.weights.fingerprint import ViewSums

    torch.manual_seed(4)
    sent = [("a", torch.randn(16, 32)), ("b", torch.randn(3, 5, dtype=torch.bfloat16)),
            ("c", torch.randn(7, dtype=torch.bfloat16)), ("d", torch.randn(64, 16, dtype=torch.bfloat16))]
    packer = BucketPacker.for_tensors(sent, bucket_bytes=2048, dtype=torch.bfloat16)
    buckets = packer.pack(sent)
    assert len(buckets) > 1
    received = [view for bucket in buckets for view in unpack_bucket(bucket)]
    other = torch.randn(12, 8, dtype=torch.bfloat16)
    extra = [("t", other.t()), ("o1", other[0:4]), ("o2", other[2:6]), ("i", torch.arange(5))]  # o1, o2 overlap
    named = received + extra
    sums = ViewSums()
    first = sums(named)
    assert first == tensor_sums(named) == {n: _reference(t) for n, t in named}
    assert {n: first[n] for n, _ in sent} == bucket_sums(buckets)  # the receiver's sums are the sender's
    kept = sums._buckets
    received[3][1][5, 7] += 1.0  # a write into d's bytes: read at call time, through the kept regrouping
    again = sums(list(named))
    assert sums._buckets is kept
    assert differing(first, again) == ["d"]
    renamed = [("z" if n == "a" else n, t) for n, t in named]
    assert set(sums(renamed)) == {n for n, _ in renamed} and sums._buckets is not kept  # new names: regrouped
    fresh = [(n, t.clone()) for n, t in named]  # new tensors, each its own storage
    assert sums(fresh) == tensor_sums(fresh) == again
    assert ViewSums()([]) == {}


def test_bucket_sums_kept_for_reused_buffers_follow_each_refill():
    """`BucketSums` (a sender's fingerprint of its reused buckets): `bucket_sums`' integers after every refill,
    the row plans made once for the same bucket objects and again for new ones."""
    from rlsys.weights.fingerprint import BucketSums
    from rlsys.weights.transport import FusedPack

    torch.manual_seed(5)
    named = [("a", torch.randn(16, 32)), ("b", torch.randn(5, 3)), ("c", torch.randn(64, 8))]
    pack = FusedPack(BucketPacker.for_tensors(named, bucket_bytes=4096, dtype=torch.bfloat16), named)
    sums = BucketSums()
    first = sums(pack.buckets)
    assert first == bucket_sums(pack.buckets)
    plans = sums._plans
    named[2][1][3, 1] += 1.0
    again = sums(pack.pack(named))  # the same buffers, refilled
    assert sums._plans is plans and again == bucket_sums(pack.buckets) and differing(first, again) == ["c"]
    other = BucketPacker.for_tensors(named, bucket_bytes=4096, dtype=torch.bfloat16).pack(named)
    assert sums(other) == again and sums._plans is not plans  # new bucket objects: planned again
