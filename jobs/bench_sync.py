"""`python -m jobs.bench sync`: the weight push learner -> vLLM on one GPU and sleep/wake cycles (jobs/bench.py says
what each column is)."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from jobs.bench_models import GIB, model_folder


async def bench_sync(args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from jobs.weight_sync import canary_sequence
    from rlsys.algos import token_logprobs
    from rlsys.engines.vllm_engine import VLLMEngine, device_total_bytes, memory_fraction
    from rlsys.weights.buckets import BucketPacker
    from rlsys.weights.fingerprint import bucket_sums, differing
    from rlsys.weights.transport import CudaIpcTransport, FusedPack

    path = model_folder(model_name, Path(args.cache))
    t0 = time.perf_counter()
    engine = VLLMEngine(str(path), max_batch_size=32, seed=0, dtype="bfloat16",
                        gpu_memory_utilization=memory_fraction(args.budget_gib, device_total_bytes()),
                        max_model_len=1024, enforce_eager=args.enforce_eager)
    engine_start_s = time.perf_counter() - t0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    params = list(model.named_parameters())
    packer = BucketPacker.for_tensors(params, bucket_bytes=args.bucket_mb << 20, device="cuda")
    fused = FusedPack(packer, params)  # what Learner.export_weights packs with
    transport = CudaIpcTransport()
    nbytes = packer.total_bytes
    prompt, cont = canary_sequence(str(path))

    @torch.no_grad()
    def learner_score() -> list[float]:
        ids = torch.tensor([prompt + cont], device="cuda")
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return token_logprobs(logits, ids[:, 1:])[0, len(prompt) - 1 :].tolist()

    async def canary_diff() -> float:
        ref = learner_score()
        got = await engine.score(prompt, cont)
        return sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)

    async def one_push(canary: bool = True) -> dict[str, float]:
        with torch.no_grad():  # a stand-in for an optimizer step: every parameter changes a little
            for _, p in params:
                p.mul_(1.0 + 1e-3)
        torch.cuda.synchronize()
        t = time.perf_counter()
        buckets = fused.pack(params)
        torch.cuda.synchronize()
        t_pack = time.perf_counter()
        payload = transport.export(buckets)
        t_handle = time.perf_counter()
        count = await engine.load_payload(transport, payload)
        t_load = time.perf_counter()
        if count != len(params):
            raise RuntimeError(f"push loaded {count} tensors, sent {len(params)}")
        # the per-push check (sync.fingerprint): the learner's bit sums of the buckets, the engine's of its weights;
        # in the job both sides run at once, here one after the other
        sent = bucket_sums(buckets)
        t_sums = time.perf_counter()
        held = await engine.weights_fingerprint()
        t_fingerprint = time.perf_counter()
        if held is not None and differing(sent, held):
            raise RuntimeError(f"fingerprint: the engine holds other bits than sent for {differing(sent, held)[:3]}")
        diff = await canary_diff() if canary else float("nan")  # no canary while the KV cache sleeps
        t_canary = time.perf_counter()
        ms = {"pack_ms": (t_pack - t) * 1e3, "handle_ms": (t_handle - t_pack) * 1e3,
              "load_ms": (t_load - t_handle) * 1e3, "worker_ms": engine.last_load.get("worker_ms", float("nan")),
              "fingerprint_learner_ms": (t_sums - t_load) * 1e3, "fingerprint_engine_ms": (t_fingerprint - t_sums) * 1e3,
              "fingerprinted": held is not None, "canary_ms": (t_canary - t_fingerprint) * 1e3,
              "path": engine.last_load.get("path")}
        ms["total_ms"] = ms["pack_ms"] + ms["handle_ms"] + ms["load_ms"]
        ms["canary_diff"] = diff
        return ms

    first = await one_push()
    pushes = [await one_push() for _ in range(args.pushes)]
    cycles: dict[str, list[dict[str, float]]] = {}
    for level in args.sleep_levels:
        runs = []
        for _ in range(args.cycles):
            t = time.perf_counter()
            await engine.sleep(level)
            t_sleep = time.perf_counter()
            await engine.wake(["weights"])
            t_wake_w = time.perf_counter()
            push = await one_push(canary=False)
            t_push = time.perf_counter()
            await engine.wake(["kv_cache"])
            await engine.reset_prefix_cache()
            t_wake_kv = time.perf_counter()
            runs.append({"sleep_s": t_sleep - t, "wake_weights_s": t_wake_w - t_sleep,
                         "wake_kv_s": t_wake_kv - t_push, "push_ms": push["total_ms"],
                         "canary_diff": await canary_diff(),
                         "sleep_wake_s": (t_sleep - t) + (t_wake_w - t_sleep) + (t_wake_kv - t_push)})
        cycles[f"level{level}"] = runs
    await engine.shutdown()

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    gib = nbytes / GIB
    steady = {k: median(pushes, k) for k in ("pack_ms", "handle_ms", "load_ms", "worker_ms", "fingerprint_learner_ms",
                                             "fingerprint_engine_ms", "canary_ms", "total_ms")}
    return {
        "model": model_name, "tensors": len(params), "bytes": nbytes, "gib": gib, "buckets": len(packer.buffers),
        "engine_start_s": engine_start_s, "enforce_eager": args.enforce_eager,
        "first_push": first, "pushes": pushes, "steady_median": steady,
        "ms_per_gib": steady["total_ms"] / gib, "gib_per_s": gib / (steady["total_ms"] / 1e3),
        "canary_diff_max": max(p["canary_diff"] for p in [first, *pushes]),
        "fingerprinted": all(p["fingerprinted"] for p in pushes),
        "paths": sorted({p["path"] for p in pushes}),
        "sleep_wake": {lvl: {k: median(rows, k) for k in rows[0]} for lvl, rows in cycles.items()},
        "sleep_wake_runs": cycles,
    }


def print_sync_table(r: dict[str, Any]) -> None:
    s = r["steady_median"]
    f = r["first_push"]
    print(f"\nweight push, {r['model']}: {r['tensors']} tensors, {r['gib']:.3f} GiB bf16 in {r['buckets']} bucket(s); "
          f"engine start {r['engine_start_s']:.1f} s")
    print(f"{'':14}{'pack':>9}{'handle':>9}{'load':>9}{'(worker)':>10}{'canary':>9}{'total':>9}  ms")
    for label, row in (("first push", f), (f"median of {len(r['pushes'])}", s)):
        print(f"{label:14}{row['pack_ms']:9.2f}{row['handle_ms']:9.2f}{row['load_ms']:9.2f}{row['worker_ms']:10.2f}"
              f"{row['canary_ms']:9.2f}{row['total_ms']:9.2f}")
    print(f"refit: {r['ms_per_gib']:.2f} ms/GiB, {r['gib_per_s']:.1f} GiB/s; copy path {r['paths']}; "
          f"canary max |dlogp| {r['canary_diff_max']:.3g}")
    print(f"fingerprint (median): learner {s['fingerprint_learner_ms']:.2f} ms, engine {s['fingerprint_engine_ms']:.2f} ms"
          f" (every push checked: {r['fingerprinted']}) against canary {s['canary_ms']:.2f} ms and push "
          f"{s['total_ms']:.2f} ms")
    for level, m in r["sleep_wake"].items():
        print(f"{level}: sleep {m['sleep_s']:.3f} s, wake weights {m['wake_weights_s']:.3f} s, wake kv "
              f"{m['wake_kv_s']:.3f} s -> sleep+wake {m['sleep_wake_s']:.3f} s/step (push {m['push_ms']:.2f} ms, "
              f"canary {m['canary_diff']:.3g})")
