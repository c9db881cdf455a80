"""Benchmarks of the GPU path. `python -m jobs.bench sync --model tiny qwen0.5b-random [--out FILE.json]`

`sync`: the weight push learner -> vLLM on one GPU, without Ray in between (the learner side runs in this
process, vLLM's engine core in its own, so the CUDA IPC crosses processes as in a job). Per push:
- pack: the learner's parameters copied into the reusable bucket buffers (`FusedPack`, as the learner does);
- handle: `CudaIpcTransport.export` (a `reduce_tensor` per buffer on the first push, cached afterwards);
- load: `VLLMEngine.load_payload`: one `collective_rpc`, the worker opens (first push) or reuses the mapping
  and copies into the model; `worker` is the part spent inside vLLM's worker;
- canary: the fixed sequence scored by vLLM and by the learner, compared;
- total: pack + handle + load (the refit itself); GiB/s and ms/GiB over the bf16 bytes pushed.
Then sleep/wake cycles as the driver runs them (sleep(level), wake weights, push, wake KV cache, reset
the prefix cache), per level, timing sleep and the two wakes. Prints a table; `--out` writes the JSON.

The random 0.5B model has Qwen2.5-0.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocab 151936, tied embeddings) and rlsys's tiny tokenizer: the weights are random, the sizes are real.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

QWEN05B_SIZES = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                 "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                 "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
GPU_TINY_SIZES = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}  # head_dim 64 (tests/gpu/conftest.py)
GIB = 1 << 30


def model_folder(name: str, cache: Path) -> Path:
    """An HF folder for ``name``: the GPU tiny model, or the random Qwen2.5-0.5B-shaped model (built once)."""
    from rlsys.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(cache / "tiny", **GPU_TINY_SIZES)
    if name == "tiny":
        return tiny
    if name != "qwen0.5b-random":
        raise SystemExit(f"unknown --model {name!r}; expected tiny or qwen0.5b-random")
    out = cache / "qwen0.5b-random"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(**QWEN05B_SIZES, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                         use_sliding_window=False, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # transformers 5 writes only `rope_parameters`; older readers would use rope_theta=10000 (models/README.md)
    cfg_file = tmp / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "rope_theta": 1000000.0}, indent=2))
    tmp.rename(out)
    del model
    torch.cuda.empty_cache()
    return out


async def bench_sync(args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from jobs.cluster import canary_sequence
    from rlsys.algos import token_logprobs
    from rlsys.engines.vllm_engine import VLLMEngine, device_total_bytes, memory_fraction
    from rlsys.weights.buckets import BucketPacker
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
        diff = await canary_diff() if canary else float("nan")  # no canary while the KV cache sleeps
        t_canary = time.perf_counter()
        ms = {"pack_ms": (t_pack - t) * 1e3, "handle_ms": (t_handle - t_pack) * 1e3,
              "load_ms": (t_load - t_handle) * 1e3, "worker_ms": engine.last_load.get("worker_ms", float("nan")),
              "canary_ms": (t_canary - t_load) * 1e3, "path": engine.last_load.get("path")}
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
    steady = {k: median(pushes, k) for k in ("pack_ms", "handle_ms", "load_ms", "worker_ms", "canary_ms", "total_ms")}
    return {
        "model": model_name, "tensors": len(params), "bytes": nbytes, "gib": gib, "buckets": len(packer.buffers),
        "engine_start_s": engine_start_s, "enforce_eager": args.enforce_eager,
        "first_push": first, "pushes": pushes, "steady_median": steady,
        "ms_per_gib": steady["total_ms"] / gib, "gib_per_s": gib / (steady["total_ms"] / 1e3),
        "canary_diff_max": max(p["canary_diff"] for p in [first, *pushes]),
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
    for level, m in r["sleep_wake"].items():
        print(f"{level}: sleep {m['sleep_s']:.3f} s, wake weights {m['wake_weights_s']:.3f} s, wake kv "
              f"{m['wake_kv_s']:.3f} s -> sleep+wake {m['sleep_wake_s']:.3f} s/step (push {m['push_ms']:.2f} ms, "
              f"canary {m['canary_diff']:.3g})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sync = sub.add_parser("sync", help="weight push learner -> vLLM (CUDA IPC), sleep/wake")
    sync.add_argument("--model", nargs="+", default=["tiny"], help="tiny | qwen0.5b-random (several: one after the other)")
    sync.add_argument("--pushes", type=int, default=20, help="timed pushes after the first")
    sync.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    sync.add_argument("--sleep-levels", type=int, nargs="+", default=[1, 2])
    sync.add_argument("--bucket-mb", type=int, default=512)
    sync.add_argument("--budget-gib", type=float, default=8.0, help="vLLM's GPU memory budget")
    sync.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    sync.add_argument("--cache", default="/tmp/rlsys-bench", help="where model folders are built")
    sync.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    # this process touches CUDA before vLLM starts its engine core: fork would break the child
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    results: dict[str, Any] = {}
    failed = False
    for name in args.model:
        try:
            results[name] = asyncio.run(bench_sync(args, name))
            print_sync_table(results[name])
        except Exception as err:  # one model failing must not hide the others' numbers; reported, exit 1
            failed = True
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        if args.out:  # after each model, so a timeout still leaves what was measured
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running main
    sys.exit(main())
