"""LoRA adapter push time on one GPU (issue 27, item 3: an r=16 adapter push of the 7B model in <= 5 ms).

A vLLM engine serving a random Qwen2.5-shaped model (`jobs.bench` builds it once: qwen7b-random, qwen14b-random, ...)
with LoRA on (`VLLMEngine.set_lora`: merged into the weights, or with `--serve adapter` served by vLLM's LoRA layers
from one slot), and the real learner (`actors.learner.Learner`, bf16 base, peft
adapters) in this process; each push perturbs every adapter (a stand-in for an optimizer step), then times
export (pack into the reused buckets + CUDA IPC handles), the engine's load (one RPC; the worker rebuilds the views
and merges W = W_base + (alpha/r) B A into every targeted layer, or copies A and scale x B into the slot) and the
worker's share. The canary's mean |logprob
difference| after the last push checks that the merged weights are the learner's. Prints a summary; `--out` JSON.

    python scripts/lora_push_bench.py --model qwen7b-random --rank 16 [--targets q_proj,v_proj] [--serve adapter]
        [--out lora7b.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jobs.host import host, host_line  # noqa: E402  (after the path: the script runs from anywhere)


async def bench(args: argparse.Namespace) -> dict:
    import torch

    from actors.learner import Learner
    from jobs.bench_models import model_folder
    from jobs.placement import learner_settings
    from jobs.weight_sync import canary_sequence
    from rlsys.config import load_config
    from rlsys.engines.vllm_engine import VLLMEngine, device_total_bytes, memory_fraction
    from rlsys.weights.transport import CudaIpcTransport

    path = str(model_folder(args.model, Path(args.cache)))
    targets = json.dumps(args.targets.split(",")) if args.targets else None
    cfg = load_config(flags={"--ckpt": path}, overrides=[
        "learner.lora.enabled=true", f"learner.lora.rank={args.rank}", f"learner.lora.alpha={2 * args.rank}",
        *([f"learner.lora.target_modules={targets}"] if targets else []), f"learner.lora.serve={args.serve}"])
    lora = cfg.learner.lora
    engine = VLLMEngine(path, max_batch_size=32, seed=0, dtype="bfloat16",
                        gpu_memory_utilization=memory_fraction(args.budget_gib, device_total_bytes()),
                        max_model_len=1024, enforce_eager=True,
                        lora_adapter=(lora.rank, tuple(lora.target_modules)) if lora.serve == "adapter" else None)
    await engine.set_lora(cfg.learner.lora.scale())
    learner = Learner(learner_settings(cfg, path), path)
    learner.open_transports([CudaIpcTransport()], args.bucket_mb << 20)
    receiver = CudaIpcTransport()
    adapters = learner._pushed()

    rows = []
    for _ in range(args.pushes + 1):
        with torch.no_grad():
            for p in learner.params:
                p.add_(torch.randn_like(p), alpha=1e-3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        payload = learner.export_weights()
        t1 = time.perf_counter()
        count = await engine.load_payload(receiver, payload)
        t2 = time.perf_counter()
        learner.ipc_collect()
        if count != len(adapters):
            raise RuntimeError(f"push loaded {count} tensors, sent {len(adapters)}")
        load = engine.last_load  # the load's split: pickle + RPC (its worker part: unpickle, receive, apply)
        rows.append({"export_ms": (t1 - t0) * 1e3, "load_ms": (t2 - t1) * 1e3, "worker_ms": load["worker_ms"],
                     "total_ms": (t2 - t0) * 1e3,
                     **{k: load[k] for k in ("pickle_ms", "rpc_ms", "unpickle_ms", "receive_ms", "apply_ms")}})
    nbytes = learner.sender.packer.total_bytes  # what travels: the adapters in the engine's dtype
    prompt, cont = canary_sequence(path)
    ref, got = learner.score(prompt, cont), await engine.score(prompt, cont)
    canary = sum(abs(a - b) for a, b in zip(ref, got)) / len(ref)
    kept = engine.last_load.get("kept_base_mib")
    await engine.shutdown()
    steady = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    return {"host": host(), "gpu": torch.cuda.get_device_name(),
            "model": args.model, "rank": args.rank, "targets": cfg.learner.lora.target_modules, "serve": args.serve,
            "path": engine.last_load.get("path"),
            "adapter_tensors": len(adapters), "adapter_mib": nbytes / 2**20, "kept_base_mib": kept,
            "first_push": rows[0], "steady_median": steady, "steady_min_total_ms": min(r["total_ms"] for r in rows[1:]),
            "canary_diff": canary, "pushes": rows,
            "peak_allocated_gib_this_process": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen7b-random", help="a jobs.bench model name (tiny, qwen7b-random, ...)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", help="comma-separated target modules (default: learner.lora's, all projections)")
    parser.add_argument("--serve", choices=("merged", "adapter"), default="merged", help="learner.lora.serve")
    parser.add_argument("--pushes", type=int, default=20, help="timed pushes after the first")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=40.0, help="vLLM's GPU memory share")
    parser.add_argument("--cache", default="/tmp/rlsys-bench", help="where model folders are built")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process holds CUDA (the learner)
    result = asyncio.run(bench(args))
    s = result["steady_median"]
    print(f"LoRA r={result['rank']} on {','.join(result['targets'])} of {result['model']}, {result['path']}: "
          f"{result['adapter_tensors']} tensors, {result['adapter_mib']:.1f} MiB; "
          f"kept base {result['kept_base_mib']} MiB")
    print(f"push median: total {s['total_ms']:.2f} ms = export {s['export_ms']:.2f} + load {s['load_ms']:.2f} "
          f"(pickle {s['pickle_ms']:.2f} + rpc {s['rpc_ms']:.2f}, of which worker {s['worker_ms']:.2f} = unpickle "
          f"{s['unpickle_ms']:.2f} + receive {s['receive_ms']:.2f} + apply {s['apply_ms']:.2f}); "
          f"first push {result['first_push']['total_ms']:.1f} ms; canary diff {result['canary_diff']:.4f}")
    print(f"fastest push {result['steady_min_total_ms']:.2f} ms; {host_line(result['host'])}; {result['gpu']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
