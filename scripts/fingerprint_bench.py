"""How fast can the weight fingerprint be? Ways to take the per-tensor bit sums of a Qwen2.5-0.5B-shaped push.

    python scripts/fingerprint_bench.py [--repeats 20] [--out FILE.json]      # a CUDA GPU; torch only, no vLLM
    python scripts/fingerprint_bench.py --adapter [--device cpu]               # a LoRA receiver's check, any device

Issue 24, item 4 wants the per-push check to cost no more than the push (5.8 ms for these shapes on an H200).
The first fingerprint launched one int16 -> int64 reduction per tensor from Python (290 here), which measured
13.8-14.0 ms a side in `jobs.bench sync`. Compared here, on the same 290 bf16 tensors:

- eager: that first way (one int64 sum of the int16 elements per tensor);
- rlsys: `tensor_sums` (32-bit words per tensor, int32, the views made at each call), `WordSums` (an engine's:
  the same with the views made once) and `bucket_sums` (a learner's: the same tensors packed in one bucket, summed
  flat), which must agree with each other and with the words' sums;
- graph: the same 290 reductions captured once into a CUDA graph writing one int64 vector (an engine's parameters
  and a learner's buckets never move, so the capture stays valid), replayed per check;
- flat: the tensors in one buffer at 128-element-aligned offsets (a learner's bucket is one buffer): one row-sum
  kernel over rows of 128 elements, a cumulative sum and a gather give every tensor's sum in three kernels.

`--adapter` times a LoRA receiver's check instead: the 392 adapter tensors of a Qwen2.5-7B shape with r=16 on every
projection (77 MiB in bf16), packed as the learner packs them and received as views of its buckets, summed by
`tensor_sums` (one reduction per view, as rlsys/lora.py did) and by `ViewSums` (the views regrouped into their
buckets once, each bucket summed flat).

Each check ends with the sums on the host (`.tolist()`), as the real one does. Every way must give the eager sums
exactly (asserted). Eager and flat are also timed accumulating in int32 (wrapping: still exact modulo 2**32), and
reading the bf16 pairs as int32 words (half the elements, no widening cast). Prints one JSON object: the median ms
of each over `--repeats` checks after two warm-ups.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlsys.weights.buckets import BucketPacker, unpack_bucket
from rlsys.weights.fingerprint import ViewSums, WordSums, bucket_sums, tensor_sums

ROW = 128  # the flat layout's row: divides every tensor's element count here (the smallest, k/v biases, is 128)


def qwen05b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 290 tensors a Qwen2.5-0.5B push carries (the embedding is tied to the head and pushed once)."""
    h, kv, inter = 896, 128, 4864
    shapes = [("model.embed_tokens.weight", (151936, h))]
    for i in range(24):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (inter, h)),
                   (p + "mlp.up_proj.weight", (inter, h)), (p + "mlp.down_proj.weight", (h, inter)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,))]


def lora7b_shapes(rank: int = 16) -> list[tuple[str, tuple[int, ...]]]:
    """The 392 adapter tensors (A: rank x in, B: out x rank) of a Qwen2.5-7B shape with LoRA on every projection."""
    h, kv, inter = 3584, 512, 18944
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
            "mlp.down_proj": (inter, h)}
    return [(f"model.layers.{i}.{module}.lora_{part}", (rank, d_in) if part == "A" else (d_out, rank))
            for i in range(28) for module, (d_in, d_out) in dims.items() for part in "AB"]


def timed(fn, repeats: int) -> tuple[float, object]:
    for _ in range(2):
        out = fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    p.add_argument("--adapter", action="store_true", help="a LoRA receiver's check (7B shape, r=16) instead")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.adapter:
        return report(adapter_views(torch.device(args.device), args.repeats), args.out)
    dev = torch.device("cuda")
    shapes = qwen05b_shapes()
    sizes = [torch.Size(s).numel() for _, s in shapes]
    assert all(n % ROW == 0 for n in sizes), "the flat layout needs every size to be a multiple of ROW"
    gen = torch.Generator(device=dev).manual_seed(0)
    # separate allocations, as an engine's parameters
    named = [(name, torch.randn(s, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16))
             for name, s in shapes]
    names = [n for n, _ in named]

    def int64_elements() -> dict[str, int]:  # the first fingerprint: int16 elements summed in int64 per tensor
        sums = torch.stack([t.view(torch.int16).sum(dtype=torch.int64) for _, t in named]).tolist()
        return dict(zip(names, sums))

    eager_ms, eager = timed(int64_elements, args.repeats)
    engine_ms, engine_sums = timed(lambda: tensor_sums(named), args.repeats)
    word_sums = WordSums(named)  # an engine's: views made once, as actors/vllm_ext.py keeps them with its plan
    engine_once_ms, engine_once = timed(word_sums, args.repeats)
    assert engine_once == engine_sums, "rlsys: WordSums differ from tensor_sums"
    packer = BucketPacker.for_tensors(named, bucket_bytes=2 << 30, device=dev)  # one bucket, as a 0.5B push
    buckets = packer.pack(named)
    learner_ms, learner_sums = timed(lambda: bucket_sums(buckets), args.repeats)
    assert learner_sums == engine_sums, "rlsys: a bucket's flat sums differ from the per-tensor ones"

    # graph: the 290 reductions captured once into one int64 vector
    out = torch.zeros(len(named), dtype=torch.int64, device=dev)
    views = [t.view(torch.int16) for _, t in named]

    def reductions():
        for i, v in enumerate(views):
            out[i] = v.sum(dtype=torch.int64)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        reductions()  # warm-up outside the capture (allocator, kernels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reductions()

    def graph_check():
        graph.replay()
        return dict(zip(names, out.tolist()))

    graph_ms, graphed = timed(graph_check, args.repeats)

    # flat: one buffer (a learner's bucket), row sums, a cumulative sum, a gather
    total = sum(sizes)
    flat = torch.empty(total, dtype=torch.bfloat16, device=dev)
    offsets, at = [], 0
    for (_, t), n in zip(named, sizes):
        flat[at:at + n].copy_(t.reshape(-1))
        offsets.append(at)
        at += n
    ends = torch.tensor([(o + n) // ROW for o, n in zip(offsets, sizes)], device=dev)
    starts = torch.tensor([o // ROW for o in offsets], device=dev)

    def flat_sums(bits: torch.dtype, acc: torch.dtype) -> list[int]:
        """Every tensor's sum from the flat buffer read as ``bits``: row sums in ``acc``, a cumulative sum, a
        gather at the tensors' row bounds (int32: all of it wrapping mod 2**32)."""
        words = flat.view(bits)
        rows = words.view(-1, ROW * words.numel() // total).sum(1, dtype=acc)
        csum = torch.cat([torch.zeros(1, dtype=acc, device=dev), rows.cumsum(0, dtype=acc)])
        return (csum[ends] - csum[starts]).tolist()

    def flat_check():
        return dict(zip(names, flat_sums(torch.int16, torch.int64)))

    flat_ms, flat_by_name = timed(flat_check, args.repeats)

    # int32 accumulation: integer addition mod 2**32 is as exact and order-free as in int64 (the same wrap on both
    # sides), a change of one int16 element can never be a multiple of 2**32, and the kernels move half the bytes
    def eager32_check():
        return torch.stack([v.sum(dtype=torch.int32) for v in views]).tolist()

    def flat32_check():
        return flat_sums(torch.int16, torch.int32)

    def words_check():  # bf16 pairs read as int32 words, summed mod 2**32: half the elements, no conversion
        return flat_sums(torch.int32, torch.int32)

    words_ms, words = timed(words_check, args.repeats)
    assert [v % 2**32 for v in words] == [engine_sums[n] for n in names], "rlsys: not the words' sums"
    words32 = [t.view(torch.int32) for _, t in named]  # an engine's separate parameters, read as words
    eager_words_ms, _ = timed(lambda: torch.stack([w.sum(dtype=torch.int32) for w in words32]).tolist(), args.repeats)
    eager32_ms, eager32 = timed(eager32_check, args.repeats)
    flat32_ms, flat32 = timed(flat32_check, args.repeats)
    assert flat32 == eager32, "int32: the flat layout's sums differ from the per-tensor ones"
    wrap = [(v + 2**31) % 2**32 - 2**31 for v in eager.values()]
    int32_agrees = eager32 == wrap  # the int64 sums taken mod 2**32: what a wrapping int32 sum must give
    assert graphed == eager, "the graph's sums differ from the eager ones"
    assert flat_by_name == eager, "the flat layout's sums differ from the eager ones"
    gib = total * 2 / 2**30
    result = {"tensors": len(named), "gib": round(gib, 3), "repeats": args.repeats, "eager_ms": round(eager_ms, 3),
              "graph_ms": round(graph_ms, 3), "flat_ms": round(flat_ms, 3), "same_sums": True,
              "eager_int32_ms": round(eager32_ms, 3), "flat_int32_ms": round(flat32_ms, 3),
              "flat_int32_words_ms": round(words_ms, 3), "eager_int32_words_ms": round(eager_words_ms, 3),
              "rlsys_tensor_sums_ms": round(engine_ms, 3),
              "rlsys_word_sums_ms": round(engine_once_ms, 3), "rlsys_bucket_sums_ms": round(learner_ms, 3),
              "int32_equals_int64_mod_2_32": int32_agrees,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    return report(result, args.out)


def adapter_views(dev: torch.device, repeats: int) -> dict:
    """`tensor_sums` against `ViewSums` over the received views of a 7B r=16 adapter push (see the docstring)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    sent = [(name, torch.randn(s, device=dev, generator=gen)) for name, s in lora7b_shapes()]  # fp32, as peft's
    packer = BucketPacker.for_tensors(sent, device=dev, dtype=torch.bfloat16)  # the learner's cast and buckets
    buckets = packer.pack(sent)
    received = [view for bucket in buckets for view in unpack_bucket(bucket)]
    per_view_ms, per_view = timed(lambda: tensor_sums(received), repeats)
    view_sums = ViewSums()
    regrouped_ms, regrouped = timed(lambda: view_sums(received), repeats)
    assert per_view == regrouped == bucket_sums(buckets), "ViewSums differ from tensor_sums"
    return {"tensors": len(received), "mib": round(sum(b.nbytes for b in buckets) / 2**20, 1),
            "buckets": len(buckets), "repeats": repeats, "tensor_sums_ms": round(per_view_ms, 3),
            "view_sums_ms": round(regrouped_ms, 3), "same_sums": True,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}


def report(result: dict, out: str | None) -> int:
    print(json.dumps(result))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
