"""Benchmarks of the job: `python -m jobs.bench {step,proxy,learner,sync,cpu-decode} ...` (docs/performance.md: the commands).

`step`: N steps of a config through the real job (jobs/train.py's `run_training`, Ray actors and all), then the
step-time breakdown from metrics.jsonl over the steps after the warm-up: generation (seconds the engine had a
request in flight), agent/reward (the rest of the rollout phase), sleep, train (learner compute, trajectory fetch,
call overhead), push, wake, canary, and the driver/object-store remainder; tokens/s; the overhead fraction
1 - (generation + learner compute) / step; GPU memory per phase (null on CPU). `--random-reward` scores every
trajectory with a deterministic pseudo-random number, so a random-weight model still trains every sequence.

`proxy`: the environment's first requests (`Environment.first_request`: chat template with the tools, the job's
sampling, `n_samples` each; meant for single-request agents such as the default environment's) (a) straight
into the rollout actor's engine (`RolloutWorker.bench_generate`) and (b) through the whole agent path (env worker
-> openai client -> proxy -> engine -> tool-call parser), on the same engine in one run; tokens/s of both and
the ratio b/a. The engine follows `rollout.engine` (auto: vLLM on a GPU, transformers on CPU).

`proxy-cpu`: the proxy's own CPU cost per request, with nothing else in its process: the real app and uvicorn with
an engine that answers at once (`--new-tokens` random ids), called by the default environment's agent with the
openai client from this process (`--requests` at once, `--boards` distinct boards, i.e. requests/boards samples of
each); the server process's CPU seconds per request (`time.process_time`). `--http h11` and `--render-cache 0`
measure the proxy without httptools and without its render cache. CPU only, no Ray.

`cpu-decode`: the CPU engine's generate on the main job's rollout (configs/tictactoe-tiny-gspo.toml: 8 items x 8
samples, its environment's first requests, its temperature/top-p/max_new_tokens, the main recipe's model shape
`rlsys:tiny-h16` with random weights), with the
transformers loop (old) and rlsys/engines/cpu_decode.py (new) alternating; tokens/s of both, the ratio, and how many
answers are equal.

`learner`: the learner alone (actors/learner.py's `Learner.train`, no Ray, no engine) on synthetic GSPO batches of
a config's shape: `--groups` prompts of `--prompt-tokens` random ids, `--samples` answers each with lengths drawn
log-uniformly in [`--answer-min`, `--answer-max`] (gsm's spread), rewards that give every answer an advantage.
Each `--variant NAME=key=value,...` (default: the learner's two row orders, `learner.length_order` true / false)
builds its own learner from the same weights and trains `--warmup` + `--steps` steps on the same batches; per
variant the median `time/learner_compute`, forward+backward tokens/s (the rows' real tokens over that time),
`train/padded_frac` and peak memory. The learner phase of a job, measured without the rollout sharing the device.

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

The random models have Qwen2.5-0.5B's or Qwen2.5-1.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocab 151936, tied embeddings; 1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960) and
rlsys's tiny tokenizer: the weights are random, the sizes are real.
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlsys.envs.base import Environment

QWEN05B_SIZES = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                 "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                 "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
QWEN15B_SIZES = {**QWEN05B_SIZES, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                 "intermediate_size": 8960}
# Qwen2.5-7B's and -14B's shapes (untied embeddings): the LoRA memory goals of issue 27 (24 / 48 GiB budgets)
QWEN7B_SIZES = {**QWEN05B_SIZES, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN14B_SIZES = {**QWEN7B_SIZES, "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                 "num_key_value_heads": 8, "intermediate_size": 13824}
RANDOM_MODELS = {"qwen0.5b-random": QWEN05B_SIZES, "qwen1.5b-random": QWEN15B_SIZES, "qwen7b-random": QWEN7B_SIZES,
                 "qwen14b-random": QWEN14B_SIZES}
GPU_TINY_SIZES = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}  # head_dim 64 (tests/gpu/conftest.py)
GIB = 1 << 30


def model_folder(name: str, cache: Path) -> Path:
    """An HF folder for ``name``: the GPU tiny model, or a random Qwen2.5-shaped model (built once)."""
    from rlsys.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(cache / "tiny", **GPU_TINY_SIZES)
    if name == "tiny":
        return tiny
    if name not in RANDOM_MODELS:
        raise SystemExit(f"unknown --model {name!r}; expected tiny or one of {sorted(RANDOM_MODELS)}")
    out = cache / name
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(**RANDOM_MODELS[name], bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                         use_sliding_window=False, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
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
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def model_ckpt(name: str | None, cache: Path) -> str | None:
    """`--model` of step/proxy: a named bench model or any `model.ckpt` value, passed through. A named model is
    built in a child process (`python -m jobs.bench model`): building it here would leave this driver holding a
    CUDA context (~0.5 GiB) that the job's memory measurements would count."""
    if name is None or not (name == "tiny" or name in RANDOM_MODELS):
        return name
    import subprocess

    out = subprocess.run([sys.executable, "-m", "jobs.bench", "model", "--model", name, "--cache", str(cache)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building --model {name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


def random_reward(record: dict[str, Any]) -> float:
    """A reward plug-in for benchmarks (`env.reward_fn_path=jobs.bench:random_reward`): a number in [-1, 1]
    from a hash of the agent's output, so every group has a spread and every sequence gets a gradient, as in
    a run that learns (a random-weight model never calls the tool: the real reward would be -1 everywhere)."""
    import hashlib

    text = json.dumps(record.get("output"), sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return digest / 2**64 * 2.0 - 1.0


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


# ------------------------------------------------------------------ step: the job's step-time breakdown
STEP_PHASES = (  # (name, how it is computed from one metrics.jsonl row)
    ("generation", lambda r: r.get("time/generate")),
    ("agent/reward/proxy", lambda r: _sub(r.get("time/rollout"), r.get("time/generate"))),
    ("sleep", lambda r: r.get("time/sleep")),
    ("train", lambda r: r.get("time/train")),
    ("  learner compute", lambda r: r.get("time/learner_compute")),
    ("  trajectory fetch", lambda r: r.get("time/learner_fetch")),
    ("  call overhead", lambda r: _sub(r.get("time/train"), r.get("time/learner_compute"), r.get("time/learner_fetch"))),
    ("push", lambda r: r.get("time/sync")),
    ("wake", lambda r: r.get("time/wake")),
    ("canary", lambda r: r.get("time/canary")),
    ("driver/object store", lambda r: _sub(r.get("time/step"), *[r.get(f"time/{k}", 0.0) for k in
                                                                  ("rollout", "sleep", "train", "sync", "wake", "canary")])),
    ("step", lambda r: r.get("time/step")),
)
MEMORY_KEYS = ("mem/rollout_device_used_gib", "mem/asleep_device_used_gib", "mem/train_device_used_gib",
               "mem/learner_peak_allocated_gib", "mem/learner_peak_reserved_gib", "mem/learner_resident_gib",
               "mem/learner_reserved_gib")


def _sub(a: float | None, *bs: float | None) -> float | None:
    if a is None or any(b is None for b in bs):
        return None
    return a - sum(bs)


def _stats(values: list[float | None]) -> dict[str, float] | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    if not vals:
        return None
    return {"mean": statistics.fmean(vals), "median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarize_steps(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The breakdown of metrics.jsonl rows (timings over the rows after ``warmup``; memory over all rows)."""
    timed = rows[warmup:]
    if not timed:
        raise ValueError(f"{len(rows)} step(s) logged, none after the {warmup} warm-up step(s)")
    phases = {name: _stats([f(r) for r in timed]) for name, f in STEP_PHASES}

    def overhead(r: dict[str, Any]) -> float | None:
        gen, comp, step = r.get("time/generate"), r.get("time/learner_compute"), r.get("time/step")
        return None if None in (gen, comp, step) else 1.0 - (gen + comp) / step

    memory = {k.removeprefix("mem/").removesuffix("_gib"): max(r[k] for r in rows if k in r)
              for k in MEMORY_KEYS if any(k in r for r in rows)}
    if memory:
        memory["peak_total"] = max(memory.get("rollout_device_used", 0.0), memory.get("train_device_used", 0.0))
    return {
        "steps_timed": len(timed), "warmup": warmup, "phases": phases,
        "overhead_frac": _stats([overhead(r) for r in timed]),
        "tokens_per_s_rollout": _stats([r.get("perf/tokens_per_s") for r in timed]),
        "tokens_per_s_generation": _stats([r["perf/engine_tokens"] / r["time/generate"] for r in timed
                                           if r.get("time/generate") and "perf/engine_tokens" in r]),
        "tokens_per_step": _stats([r.get("perf/engine_tokens") for r in timed]),
        "memory_gib": memory or None,
        "startup": {k.removeprefix("startup/"): v for k, v in rows[0].items() if k.startswith("startup/")} or None,
    }


def bench_step(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from jobs.train import run_training
    from rlsys.config import load_config
    from rlsys.metrics import read_metrics

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="rlsys-bench-step-")
    flags = {"--max-steps": str(args.steps + args.warmup), "--run-dir": run_dir}
    ckpt = model_ckpt(args.model, Path(args.cache))
    if ckpt:
        flags["--ckpt"] = ckpt
    overrides = ["logging.progress=false"] + (["env.reward_fn_path=jobs.bench:random_reward"] if args.random_reward else [])
    cfg = load_config(args.config, flags=flags, overrides=overrides + list(args.overrides))
    loaded = time.time()
    t0 = time.perf_counter()
    with GpuPeakSampler() as gpus:
        run_training(cfg, {"config_loaded": loaded})
    wall = time.perf_counter() - t0
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = summarize_steps(rows, args.warmup)
    r = cfg.rollout
    out.update({"config": args.config, "model": cfg.model.ckpt, "run_dir": run_dir, "wall_s": wall,
                "layout": {"world_size": cfg.cluster.world_size, "tp_size": cfg.cluster.tp_size,
                           "enforce_eager": r.enforce_eager, "keep_awake": r.keep_awake},
                "gpu_peak_gib": gpus.peaks_gib(),
                "budget_gib": r.gpu_memory_budget_gib, "episodes_per_step": r.batch_size * r.n_samples,
                "per_step": [{k: v for k, v in row.items() if k.split("/")[0] in ("step", "time", "mem", "perf")}
                             for row in rows]})
    if out["memory_gib"] and r.gpu_memory_budget_gib:
        out["under_budget"] = out["memory_gib"]["peak_total"] <= r.gpu_memory_budget_gib
    return out


class GpuPeakSampler:
    """Every visible GPU's peak device memory in use (NVML, all processes) while the block runs, sampled every
    ``interval_s`` in a thread: per GPU, for runs over several GPUs (`python -m jobs.bench compare`). Without
    NVML or a GPU, ``peaks_gib()`` is None."""

    def __init__(self, interval_s: float = 0.25) -> None:
        import threading

        self.interval_s, self._stop, self._peaks = interval_s, threading.Event(), None
        self._thread = threading.Thread(target=self._run, name="rlsys-gpu-sampler", daemon=True)

    def __enter__(self) -> "GpuPeakSampler":
        try:
            import pynvml  # nvidia-ml-py, a vLLM dependency

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._nvml = pynvml
        except Exception:  # no NVML library, no driver, no GPU: nothing to sample
            return self
        self._peaks = [0] * len(self._handles)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for i, h in enumerate(self._handles):
                self._peaks[i] = max(self._peaks[i], self._nvml.nvmlDeviceGetMemoryInfo(h).used)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peaks_gib(self) -> list[float] | None:
        return None if not self._peaks else [b / GIB for b in self._peaks]


def print_step_table(r: dict[str, Any]) -> None:
    step = (r["phases"].get("step") or {}).get("mean") or float("nan")
    print(f"\nstep breakdown, {r['model']}: {r['steps_timed']} steps after {r['warmup']} warm-up, "
          f"{r['episodes_per_step']} episodes/step")
    print(f"{'phase':<24}{'mean s':>10}{'median s':>10}{'% step':>8}")
    for name, st in r["phases"].items():
        if st is None:
            print(f"{name:<24}{'-':>10}{'-':>10}{'-':>8}")
        else:
            print(f"{name:<24}{st['mean']:10.3f}{st['median']:10.3f}{100 * st['mean'] / step:7.1f}%")

    def fmt(st: dict[str, float] | None, spec: str = "{:.3f}") -> str:
        return "-" if st is None else f"{spec.format(st['mean'])} (median {spec.format(st['median'])})"

    print(f"overhead 1 - (generation + learner compute)/step: {fmt(r['overhead_frac'])}  [goal <= 0.05 on the GPU]")
    print(f"tokens/s: {fmt(r['tokens_per_s_rollout'], '{:.0f}')} over the rollout phase, "
          f"{fmt(r['tokens_per_s_generation'], '{:.0f}')} while generating")
    mem = r["memory_gib"]
    if mem:
        print("GPU memory (GiB, peak over all steps): " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
              + (f"; budget {r['budget_gib']} -> {'under' if r.get('under_budget') else 'OVER'}" if r["budget_gib"] else ""))
    else:
        print("GPU memory: null (no GPU)")
    if r["startup"]:
        print("startup (s after process start): " + ", ".join(f"{k} {v:.1f}" for k, v in r["startup"].items()))


def compare_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """`bench step` results side by side (medians over the timed steps), the throughputs also as a multiple of
    the first run's: the table of a scale-out comparison (one GPU, world_size 2, tp_size 2)."""

    def med(r: dict[str, Any], *phases: str) -> float | None:
        vals = [(r["phases"].get(p) or {}).get("median") for p in phases]
        return None if any(v is None for v in vals) else sum(vals)

    def tps(r: dict[str, Any]) -> float | None:
        return (r.get("tokens_per_s_rollout") or {}).get("median")

    def steps_per_s(r: dict[str, Any]) -> float | None:
        step = med(r, "step")
        return 1.0 / step if step else None

    def peaks(r: dict[str, Any]) -> str:
        per_gpu = r.get("gpu_peak_gib")
        if per_gpu:
            return " / ".join(f"{g:.1f}" for g in per_gpu)
        mem = r.get("memory_gib") or {}
        return f"{mem['peak_total']:.1f}" if "peak_total" in mem else "-"

    def layout(r: dict[str, Any]) -> str:
        lay = r.get("layout") or {}
        return f"{lay.get('world_size', '?')} x tp {lay.get('tp_size', '?')}"

    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else spec.format(v)

    def ratio(f, r: dict[str, Any]) -> str:
        base, v = f(runs[0][1]), f(r)
        return "" if base in (None, 0) or v is None else f" ({v / base:.2f}x)"

    rows = [
        ("GPUs (world size x tp)", lambda r: layout(r)),
        ("steps/s", lambda r: num(steps_per_s(r), "{:.3f}") + ratio(steps_per_s, r)),
        ("rollout tokens/s", lambda r: num(tps(r), "{:.0f}") + ratio(tps, r)),
        ("step s", lambda r: num(med(r, "step"), "{:.3f}")),
        ("  generation", lambda r: num(med(r, "generation"), "{:.3f}")),
        ("  agent/reward/proxy", lambda r: num(med(r, "agent/reward/proxy"), "{:.3f}")),
        ("  learner compute", lambda r: num(med(r, "  learner compute"), "{:.3f}")),
        ("  refit (push)", lambda r: num(med(r, "push"), "{:.4f}")),
        ("  sleep + wake", lambda r: num(med(r, "sleep", "wake"), "{:.4f}")),
        ("  canary", lambda r: num(med(r, "canary"), "{:.4f}")),
        ("overhead (median)", lambda r: num((r.get("overhead_frac") or {}).get("median"), "{:.3f}")),
        ("peak GiB per GPU", peaks),
    ]
    names = [n for n, _ in runs]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    lines += ["| " + label + " | " + " | ".join(f(r) for _, r in runs) + " |" for label, f in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------ proxy: direct engine vs the agent path
def first_prompts(env: Environment, items: list[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """The prompt ids the proxy renders for the environment's first request on each item
    (`Environment.first_request`; ValueError where the environment does not say what it is)."""
    from rlsys.proxy.schema import ChatCompletionRequest, template_messages, template_tools

    if env.first_request is None:
        raise ValueError(f"environment {env.name!r} does not give its first request (Environment.first_request)")
    out = []
    for item in items:
        req = ChatCompletionRequest.model_validate({"model": "m", **env.first_request(item)})
        ids = tokenizer.apply_chat_template(template_messages(req), tools=template_tools(req),
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append([int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def bench_proxy(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker
    from jobs.episodes import agent_calls, run_episodes
    from jobs.items import load_items
    from jobs.placement import engine_settings, gpu_actor_env, make_env_workers
    from jobs.session import init_ray
    from rlsys.config import load_config
    from rlsys.engines import resolve_engine_kind
    from rlsys.models.resolve import resolve_model

    flags = {"--ckpt": model_ckpt(args.model, Path(args.cache))} if args.model else {}
    cfg = load_config(args.config, flags=flags, overrides=["logging.progress=false", *args.overrides])
    env = cfg.env.environment()
    if env.first_request is None:
        raise SystemExit(f"bench proxy renders the environment's first requests; {env.name} does not give them "
                         "(Environment.first_request; another agent than the environment's has none)")
    model_path = resolve_model(cfg.model.ckpt)
    owns_ray = init_ray(cfg.cluster, "rlsys-bench-proxy")
    actors: list[Any] = []
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        where = {"num_gpus": 1, "runtime_env": {"env_vars": gpu_actor_env()}} if gpus else {}
        threads = None if gpus else max(1, os.cpu_count() or 1)
        rollout = ray.remote(RolloutWorker).options(name="rollout-bench", num_cpus=0, max_concurrency=1024,
                                                    **where).remote(engine_settings(cfg, model_path), model_path,
                                                                   num_threads=threads)
        actors.append(rollout)
        t0 = time.perf_counter()
        info = ray.get(rollout.start.remote())
        engine_start_s = time.perf_counter() - t0
        proxy = {**info, "actor": rollout}
        r = cfg.rollout
        items = load_items(cfg.data, cfg.algo.name, env)[: r.batch_size]
        prompts = first_prompts(env, items, AutoTokenizer.from_pretrained(model_path))

        def direct() -> dict[str, float]:
            return ray.get(rollout.bench_generate.remote(prompts, r.n_samples))

        def agent_path(workers: list[Any], tag: str) -> tuple[dict[str, float], list[Any]]:
            t = time.perf_counter()
            refs, summaries = run_episodes(workers, [proxy], items, r.n_samples,
                                           agent_calls(lambda g, s: f"bench-{tag}-item{g}-sample{s}"))
            wall = time.perf_counter() - t
            failed = [s.fail_reason for s in summaries if s.failed]
            return {"tokens": float(sum(s.response_len for s in summaries)), "wall_s": wall,
                    "requests": float(len(summaries)), "failed": float(len(failed)), "fail_reasons": failed[:4]}, refs

        direct()  # warm-up: engine kernels
        by_workers, first_refs = {}, None
        for v, count in enumerate(args.env_workers or [cfg.env.num_workers]):
            env = cfg.env.model_copy(update={"num_workers": count})
            workers = make_env_workers(env, nodes=[info["node_id"]], name=f"env-bench{v}")
            actors += workers
            agent_path(workers, f"warmup{v}")  # env workers' imports and HTTP connections
            rounds = []
            for k in range(args.rounds):  # alternating which path goes first, so drift favours neither
                if k % 2:
                    b, refs = agent_path(workers, f"{v}-{k}")
                    a = direct()
                else:
                    a = direct()
                    b, refs = agent_path(workers, f"{v}-{k}")
                first_refs = first_refs or refs
                rounds.append({"direct": a, "agent": b, "direct_tps": a["tokens"] / a["wall_s"],
                               "agent_tps": b["tokens"] / b["wall_s"]})
                rounds[-1]["ratio"] = rounds[-1]["agent_tps"] / rounds[-1]["direct_tps"]
            by_workers[str(count)] = {
                "env_workers": len(workers), "rounds": rounds,
                "concurrency": min(len(prompts) * r.n_samples, r.engine_max_batch,
                                   len(workers) * cfg.env.max_concurrency),
                "direct_tps": statistics.median(x["direct_tps"] for x in rounds),
                "agent_tps": statistics.median(x["agent_tps"] for x in rounds),
                "ratio": statistics.median(x["ratio"] for x in rounds)}
            for w in workers:
                ray.kill(w, no_restart=True)
        traj = ray.get(first_refs[0])
        sent = traj.segments[0].input_ids[: len(prompts[0])] if traj.segments else []
        first = next(iter(by_workers.values()))
        return {
            "model": cfg.model.ckpt,
            "engine": resolve_engine_kind(cfg.rollout.engine, torch.cuda.is_available) if not gpus else "vllm (auto, GPU)",
            "engine_start_s": engine_start_s, "prompts": len(prompts), "n_samples": r.n_samples,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
            "prompt_tokens": statistics.fmean(len(p) for p in prompts), "prompts_match": sent == prompts[0],
            "by_env_workers": by_workers,
            **{k: first[k] for k in ("env_workers", "concurrency", "rounds", "direct_tps", "agent_tps", "ratio")},
        }
    finally:
        for actor in actors[:1]:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as err:  # going down anyway; say why it was not clean
                print(f"bench proxy: rollout shutdown: {type(err).__name__}: {err}", flush=True)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if owns_ray:
            ray.shutdown()


def print_proxy_table(r: dict[str, Any]) -> None:
    print(f"\nproxy overhead, {r['model']} ({r['engine']}): {r['prompts']} prompts x {r['n_samples']} samples, "
          f"{r['prompt_tokens']:.0f}-token prompts, max_new_tokens {r['max_new_tokens']}")
    print(f"{'workers':<9}{'round':<7}{'direct tok/s':>14}{'agent tok/s':>14}{'ratio':>8}{'direct tok':>12}"
          f"{'agent tok':>11}{'failed':>8}")
    for v in r["by_env_workers"].values():
        for k, x in enumerate(v["rounds"]):
            print(f"{v['env_workers']:<9}{k:<7}{x['direct_tps']:14.0f}{x['agent_tps']:14.0f}{x['ratio']:8.3f}"
                  f"{x['direct']['tokens']:12.0f}{x['agent']['tokens']:11.0f}{x['agent']['failed']:8.0f}")
        print(f"median with {v['env_workers']} env workers (concurrency {v['concurrency']}): direct "
              f"{v['direct_tps']:.0f} tok/s, agent path {v['agent_tps']:.0f} tok/s, ratio {v['ratio']:.3f} "
              "[goal >= 0.9]")
    print(f"prompts identical on both paths: {r['prompts_match']}")


# ------------------------------------------------------------------ cpu-decode: the CPU engine's two decode loops
def synthetic_batch(groups: int, samples: int, prompt_tokens: int, answer_range: tuple[int, int], vocab: int,
                    seed: int, common_tokens: int = 0) -> list[Any]:
    """GSPO trajectories of a job's shape: ``groups`` prompts x ``samples`` answers, answer lengths log-uniform in
    ``answer_range``, random ids below ``vocab``, distinct rewards within each group (every answer has an
    advantage), as the rollout returns them (the samples of a group interleaved with the other groups'). The first
    ``common_tokens`` of every prompt are the same (a system prompt and tool schema)."""
    import math
    import random

    from rlsys.types import Segment, Trajectory

    rng = random.Random(seed)
    lo, hi = answer_range
    if not 0 <= common_tokens <= prompt_tokens:
        raise ValueError(f"common_tokens must be in 0..prompt_tokens ({prompt_tokens}), got {common_tokens}")
    common = [rng.randrange(3, vocab) for _ in range(common_tokens)]
    prompts = [common + [rng.randrange(3, vocab) for _ in range(prompt_tokens - common_tokens)] for _ in range(groups)]
    out = []
    for sample in range(samples):
        for group, prompt in enumerate(prompts):
            n = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            answer = [rng.randrange(3, vocab) for _ in range(n)]
            segment = Segment(prompt + answer, [0] * prompt_tokens + [1] * n, [0.0] * prompt_tokens + [-2.0] * n)
            out.append(Trajectory(item_id=f"p{group}", group=group, sample=sample, segments=[segment],
                                  reward=sample / max(samples - 1, 1), num_turns=1))
    return out


def bench_learner(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's learner on the same synthetic batches: median compute time, tokens/s, padding, memory."""
    import gc

    import torch

    from jobs.placement import learner_settings
    from rlsys.config import load_config
    from rlsys.models.resolve import resolve_model

    from actors.learner import Learner

    base = load_config(args.config, overrides=args.overrides)
    model_path = resolve_model(model_ckpt(args.model, Path(args.cache)) or base.model.ckpt)
    vocab = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    variants = args.variant or ["sorted=learner.length_order=true", "sampled=learner.length_order=false"]
    batches = [synthetic_batch(args.groups, args.samples, args.prompt_tokens, (args.answer_min, args.answer_max),
                               vocab, seed=k, common_tokens=args.common_tokens)
               for k in range(args.warmup + args.steps)]
    real = [sum(len(s.input_ids) for t in b for s in t.segments) for b in batches]
    out: dict[str, Any] = {"model": args.model or base.model.ckpt, "config": args.config, "groups": args.groups,
                           "samples": args.samples, "prompt_tokens": args.prompt_tokens,
                           "common_tokens": args.common_tokens, "answer_range": [args.answer_min, args.answer_max],
                           "steps": args.steps, "warmup": args.warmup, "variants": {}}
    for spec in variants:
        name, _, overrides = spec.partition("=")
        cfg = load_config(args.config, overrides=[*args.overrides, *filter(None, overrides.split(","))])
        learner = Learner(learner_settings(cfg, model_path), model_path)
        rows = [learner.train(batch) for batch in batches][args.warmup:]
        compute = [r["time/learner_compute"] for r in rows]
        out["variants"][name] = {
            "overrides": overrides, "mini_bs": cfg.learner.mini_bs, "prefix_sharing": learner.prefix_sharing,
            "compute_s": statistics.median(compute),
            "tokens_per_s": statistics.median(n / c for n, c in zip(real[args.warmup:], compute)),
            "padded_frac": statistics.fmean(r.get("train/padded_frac", 0.0) for r in rows),
            "micro_batches": statistics.fmean(r.get("train/micro_batches", 0.0) for r in rows),
            "prefix_saved_frac": statistics.fmean(r.get("train/prefix_saved_frac", 0.0) for r in rows),
            "peak_allocated_gib": max((r.get("mem/learner_peak_allocated_gib") or 0.0) for r in rows) or None,
            "loss": [r.get("train/loss") for r in rows], "device": str(learner.device)}
        del learner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["tokens_per_step"] = statistics.fmean(real[args.warmup:])
    return out


def print_learner(r: dict[str, Any]) -> None:
    print(f"\nlearner, {r['model']}: {r['groups']} prompts x {r['samples']} answers, prompt {r['prompt_tokens']} "
          f"tokens ({r.get('common_tokens', 0)} common), answers {r['answer_range'][0]}-{r['answer_range'][1]} "
          f"(log-uniform), {r['tokens_per_step']:.0f} tokens a step, median of {r['steps']} steps after {r['warmup']}")
    print(f"{'variant':<12}{'compute s':>11}{'tokens/s':>11}{'padded':>9}{'micro':>7}{'prefix saved':>14}"
          f"{'peak GiB':>10}")
    for name, v in r["variants"].items():
        peak = f"{v['peak_allocated_gib']:.2f}" if v["peak_allocated_gib"] else "-"
        print(f"{name:<12}{v['compute_s']:11.3f}{v['tokens_per_s']:11.0f}{v['padded_frac']:9.3f}"
              f"{v.get('micro_batches', 0.0):7.1f}{v['prefix_saved_frac']:14.3f}{peak:>10}")


def bench_cpu_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of ``TransformersEngine`` with its transformers loop (old) and rlsys/engines/cpu_decode.py (new) on
    the main job's rollout shape; rounds alternate which loop goes first, so drift from other load favours neither."""
    import torch
    from transformers import AutoTokenizer

    from rlsys.config import load_config
    from rlsys.engines import SamplingParams
    from rlsys.engines.transformers_engine import TransformersEngine
    from jobs.items import load_items
    from rlsys.models.resolve import resolve_model

    cfg = load_config(args.config)
    r = cfg.rollout
    boards = args.boards or r.batch_size
    samples = args.samples or r.n_samples
    new_tokens = args.max_new_tokens or r.max_new_tokens
    temperature = r.temperature if args.temperature is None else args.temperature
    top_p = r.top_p if args.top_p is None else args.top_p
    model_path = resolve_model(args.model)
    env = cfg.env.environment()
    items = load_items(cfg.data.model_copy(update={"num_items": boards, "seed": 0}), cfg.algo.name, env)[:boards]
    prompts = first_prompts(env, items, AutoTokenizer.from_pretrained(model_path))
    threads = args.threads or r.engine_threads or max(1, os.cpu_count() or 1)  # the job's engine: 1 (rlsys/config.py)
    # batch_wait_s=0: the gathered calls are all queued before the batcher runs, so each round is one batch
    engines = {name: TransformersEngine(model_path, max_batch_size=boards * samples, batch_wait_s=0.0, seed=0,
                                        num_threads=threads, fast_decode=fast)
               for name, fast in (("old", False), ("new", True))}

    async def one_round(engine: Any, seed: int) -> tuple[float, list[Any]]:
        calls = [engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                                                   seed=seed * 1000 + g * 100 + s))
                 for g, p in enumerate(prompts) for s in range(samples)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*calls)
        return time.perf_counter() - t0, outs

    async def rounds() -> list[dict[str, Any]]:
        for engine in engines.values():
            await one_round(engine, 10**6)  # warm-up: allocator, kernels, the fused weights
        out = []
        for k in range(args.rounds):
            order = list(engines) if k % 2 == 0 else list(engines)[::-1]
            timed = {name: await one_round(engines[name], k) for name in order}
            row: dict[str, Any] = {}
            for name, (wall, outs) in timed.items():
                row[f"{name}_tokens"] = sum(len(o.token_ids) for o in outs)
                row[f"{name}_s"] = wall
                row[f"{name}_tps"] = row[f"{name}_tokens"] / wall
            row["same_answers"] = sum(a.token_ids == b.token_ids for a, b in zip(timed["old"][1], timed["new"][1]))
            out.append(row)
        for engine in engines.values():
            await engine.shutdown()
        return out

    timed = asyncio.run(rounds())
    old_tps = statistics.median(x["old_tps"] for x in timed)
    new_tps = statistics.median(x["new_tps"] for x in timed)
    return {"model": args.model, "threads": threads, "torch_threads": torch.get_num_threads(), "boards": boards,
            "samples": samples, "answers": boards * samples, "max_new_tokens": new_tokens,
            "temperature": temperature, "top_p": top_p, "prompt_tokens": statistics.fmean(len(p) for p in prompts),
            "rounds": timed, "old_tps": old_tps, "new_tps": new_tps, "ratio": new_tps / old_tps,
            "same_answers": sum(x["same_answers"] for x in timed) / (len(timed) * boards * samples)}


def print_cpu_decode(r: dict[str, Any]) -> None:
    print(f"\ncpu decode, {r['model']}: {r['answers']} answers ({r['boards']} boards x {r['samples']}), "
          f"{r['prompt_tokens']:.0f}-token prompts, max_new_tokens {r['max_new_tokens']}, T {r['temperature']}, "
          f"top-p {r['top_p']}, {r['threads']} threads")
    print(f"{'round':<7}{'old tok/s':>11}{'new tok/s':>11}{'ratio':>8}{'old s':>8}{'new s':>8}{'same':>6}")
    for k, x in enumerate(r["rounds"]):
        print(f"{k:<7}{x['old_tps']:11.0f}{x['new_tps']:11.0f}{x['new_tps'] / x['old_tps']:8.2f}{x['old_s']:8.3f}"
              f"{x['new_s']:8.3f}{x['same_answers']:6d}")
    print(f"median: old {r['old_tps']:.0f} tok/s, new {r['new_tps']:.0f} tok/s, ratio {r['ratio']:.2f} [goal >= 5]; "
          f"identical answers {r['same_answers']:.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    models = f"tiny | {' | '.join(RANDOM_MODELS)}"
    step = sub.add_parser("step", help="N steps of a config: step-time breakdown, tokens/s, memory per phase")
    step.add_argument("--config", help="TOML config (overrides win)")
    step.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    step.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings")
    step.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    step.add_argument("--random-reward", action="store_true", help="score with jobs.bench:random_reward")
    step.add_argument("--run-dir", help="the job's run directory (default: a new temporary one)")
    proxy = sub.add_parser("proxy", help="the environment's prompts: direct engine generate vs the full agent path")
    proxy.add_argument("--config", help="TOML config (overrides win)")
    proxy.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    proxy.add_argument("--rounds", type=int, default=3, help="timed (direct, agent) pairs after a warm-up")
    proxy.add_argument("--env-workers", type=lambda v: [x if x == "auto" else int(x) for x in v.split(",")],
                       help="env worker counts to measure the agent path with, one after the other, comma-separated "
                            "(e.g. auto,2; default: the config's env.num_workers)")
    for p in (step, proxy):
        p.add_argument("--cache", default="/tmp/rlsys-bench", help="where named models are built")
        p.add_argument("--out", help="write the results as JSON here")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    lrn = sub.add_parser("learner", help="the learner alone on synthetic batches: tokens/s, padding, memory")
    lrn.add_argument("--config", default="configs/gsm-qwen0.5b.toml", help="the learner's settings (overrides win)")
    lrn.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    lrn.add_argument("--groups", type=int, default=8, help="prompts a step")
    lrn.add_argument("--samples", type=int, default=8, help="answers a prompt")
    lrn.add_argument("--prompt-tokens", type=int, default=450)
    lrn.add_argument("--common-tokens", type=int, default=0, help="of them, the same in every prompt")
    lrn.add_argument("--answer-min", type=int, default=100)
    lrn.add_argument("--answer-max", type=int, default=1500)
    lrn.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    lrn.add_argument("--warmup", type=int, default=1)
    lrn.add_argument("--variant", action="append", metavar="NAME=KEY=VALUE,...",
                     help="a learner to measure (repeatable; default: learner.length_order true and false)")
    lrn.add_argument("--cache", default="/tmp/rlsys-bench", help="where named models are built")
    lrn.add_argument("--out", help="write the results as JSON here")
    lrn.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides for every variant")
    cost = sub.add_parser("proxy-cpu", help="the proxy's CPU seconds per request, with an instant engine")
    cost.add_argument("--requests", type=int, default=128, help="requests at once per round")
    cost.add_argument("--boards", type=int, default=16, help="distinct boards among them")
    cost.add_argument("--rounds", type=int, default=5)
    cost.add_argument("--new-tokens", type=int, default=128, help="ids in each instant answer")
    cost.add_argument("--http", default="auto", help="uvicorn's HTTP implementation: auto (httptools) or h11")
    cost.add_argument("--render-cache", type=int, default=None, help="proxy render cache size (0: off)")
    cost.add_argument("--out", help="write the results as JSON here")
    sync = sub.add_parser("sync", help="weight push learner -> vLLM (CUDA IPC), sleep/wake")
    sync.add_argument("--model", nargs="+", default=["tiny"], help=f"{models} (several: one after the other)")
    sync.add_argument("--pushes", type=int, default=20, help="timed pushes after the first")
    sync.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    sync.add_argument("--sleep-levels", type=int, nargs="+", default=[1, 2])
    sync.add_argument("--bucket-mb", type=int, default=512)
    sync.add_argument("--budget-gib", type=float, default=8.0, help="vLLM's GPU memory budget")
    sync.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    sync.add_argument("--cache", default="/tmp/rlsys-bench", help="where model folders are built")
    sync.add_argument("--out", help="write the results as JSON here")
    cmp = sub.add_parser("compare", help="`step` results side by side (a scale-out table, markdown)")
    cmp.add_argument("runs", nargs="+", metavar="NAME=FILE.json", help="bench step JSONs; the first is the baseline")
    dec = sub.add_parser("cpu-decode", help="the CPU engine's decode loops, old vs new, on the main job's rollout")
    dec.add_argument("--config", default="configs/tictactoe-tiny-gspo.toml", help="rollout shape and sampling")
    dec.add_argument("--model", default="rlsys:tiny-h16",
                     help="any model.ckpt value (default: the main recipe's shape, configs/tictactoe-tiny-sft.toml)")
    dec.add_argument("--rounds", type=int, default=5, help="timed (old, new) pairs after a warm-up")
    dec.add_argument("--boards", type=int, help="prompts (default: the config's rollout.batch_size)")
    dec.add_argument("--samples", type=int, help="answers per prompt (default: rollout.n_samples)")
    dec.add_argument("--max-new-tokens", type=int, help="default: rollout.max_new_tokens")
    dec.add_argument("--temperature", type=float, help="default: rollout.temperature")
    dec.add_argument("--top-p", type=float, help="default: rollout.top_p")
    dec.add_argument("--threads", type=int, help="torch threads (default: the config's rollout.engine_threads)")
    dec.add_argument("--out", help="write the results as JSON here")
    build = sub.add_parser("model", help="build a named bench model; prints its folder")
    build.add_argument("--model", required=True, help=models)
    build.add_argument("--cache", default="/tmp/rlsys-bench")
    args = parser.parse_args(argv)
    if args.command == "model":
        print(model_folder(args.model, Path(args.cache)))
        return 0
    if args.command == "compare":
        runs = []
        for spec in args.runs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                parser.error(f"compare: {spec!r} is not NAME=FILE.json")
            try:
                runs.append((name, json.loads(Path(path).read_text())))
            except (OSError, ValueError) as err:
                parser.error(f"compare: {path}: {err}")
        print(compare_table(runs))
        return 0
    local = {"cpu-decode": (bench_cpu_decode, print_cpu_decode), "learner": (bench_learner, print_learner)}
    if args.command in local:  # in this process, no Ray: measure, write the JSON, print the table
        measure, show = local[args.command]
        result = measure(args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        show(result)
        return 0
    if args.command == "proxy-cpu":
        result = bench_proxy_cpu(args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"proxy CPU per request ({result['http']}, render cache {result['render_cache']}): "
              f"{result['cpu_ms_per_request']:.2f} ms median over {args.rounds} rounds of {args.requests} requests "
              f"({args.boards} boards); rounds {[round(r['wall_s'], 3) for r in result['rounds']]} s wall")
        return 0
    if args.command in ("step", "proxy"):
        from rlsys.errors import UserInputError

        try:
            result = bench_step(args) if args.command == "step" else bench_proxy(args)
        except UserInputError as err:
            print(f"rlsys: {err}", file=sys.stderr)
            return 2
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        (print_step_table if args.command == "step" else print_proxy_table)(result)
        return 0
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


def _proxy_cpu_server(conn: Any, http: str, cache: int | None, new_tokens: int) -> None:
    """`proxy-cpu`'s server process: the proxy app over an instant engine; answers each round's CPU seconds."""
    import random

    from transformers import AutoTokenizer

    from rlsys.engines.base import Engine, GenerateOutput, SamplingParams
    from rlsys.models.resolve import resolve_model
    from rlsys.proxy.server import RENDER_CACHE_SIZE, ProxyServer, create_app
    from rlsys.proxy.sessions import SessionRecorder

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("rlsys:tiny"))
    rng, vocab = random.Random(0), len(tokenizer)

    class Instant(Engine):
        max_model_len = 1024

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
            ids = [rng.randrange(100, vocab - 16) for _ in range(new_tokens)]
            return GenerateOutput(ids, [-1.0] * len(ids), "length")

        async def score(self, prompt_ids, continuation_ids):
            raise NotImplementedError

        def load_weights(self, named_tensors):
            raise NotImplementedError

    app = create_app(Instant(), tokenizer, api_token="bench", model_name="m", recorder=SessionRecorder(),
                     sampling_defaults=SamplingParams(max_new_tokens=new_tokens), max_tokens_cap=new_tokens,
                     render_cache_size=RENDER_CACHE_SIZE if cache is None else cache)

    async def serve() -> None:
        server = ProxyServer(app, http=http)
        conn.send(await server.start())
        loop = asyncio.get_running_loop()
        while (msg := await loop.run_in_executor(None, conn.recv)) != "stop":  # "tick": CPU seconds so far
            conn.send(time.process_time())
        await server.stop()

    asyncio.run(serve())


def bench_proxy_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    import httpx
    import openai

    from rlsys.config import DataConfig
    from rlsys.envs.base import DEFAULT_ENV, load_environment

    ours, theirs = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_proxy_cpu_server, daemon=True,
                                             args=(theirs, args.http, args.render_cache, args.new_tokens))
    server.start()
    url = ours.recv()
    env = load_environment(DEFAULT_ENV)
    agent = env.agent
    items = env.train_items(DataConfig(num_items=args.boards, seed=0))

    async def rounds() -> list[dict[str, float]]:
        limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
        client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=120,
                                    http_client=httpx.AsyncClient(limits=limits))
        out = []
        for r in range(args.rounds + 1):  # the first warms the connections up, not timed
            ours.send("tick")
            cpu0, t0 = ours.recv(), time.perf_counter()
            await asyncio.gather(*[agent(items[i % len(items)], client, "m") for i in range(args.requests)])
            wall = time.perf_counter() - t0
            ours.send("tick")
            if r:
                out.append({"wall_s": wall, "cpu_s": ours.recv() - cpu0})
            else:
                ours.recv()
        return out

    try:
        timed = asyncio.run(rounds())
    finally:
        ours.send("stop")
        server.join(30)
    per_request = statistics.median(r["cpu_s"] for r in timed) / args.requests
    return {"http": args.http, "render_cache": "default" if args.render_cache is None else args.render_cache,
            "requests": args.requests, "boards": args.boards, "new_tokens": args.new_tokens,
            "cpu_ms_per_request": per_request * 1e3, "rounds": timed}


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running main
    sys.exit(main())
