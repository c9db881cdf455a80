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
