"""`python -m jobs.bench step` and `compare`: N steps of a config through the real job, the step-time breakdown, and
results side by side (jobs/bench.py says what each phase is)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from jobs.bench_models import GIB, model_ckpt


def random_reward(record: dict[str, Any]) -> float:
    """A reward plug-in for benchmarks (`env.reward_fn_path=jobs.bench_step:random_reward`): a number in [-1, 1]
    from a hash of the agent's output, so every group has a spread and every sequence gets a gradient, as in
    a run that learns (a random-weight model never calls the tool: the real reward would be -1 everywhere)."""
    import hashlib

    text = json.dumps(record.get("output"), sort_keys=True, default=str)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return digest / 2**64 * 2.0 - 1.0


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
    overrides = ["logging.progress=false"] + (["env.reward_fn_path=jobs.bench_step:random_reward"] if args.random_reward else [])
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
                "gpu_peak_gib": gpus.peaks_gib(), "gpu_process_peaks": gpus.process_peaks_gib(),
                "budget_gib": r.gpu_memory_budget_gib, "episodes_per_step": r.batch_size * r.n_samples,
                "per_step": [{k: v for k, v in row.items() if k.split("/")[0] in ("step", "time", "mem", "perf")}
                             for row in rows]})
    if out["memory_gib"] and r.gpu_memory_budget_gib:
        out["under_budget"] = out["memory_gib"]["peak_total"] <= r.gpu_memory_budget_gib
    return out


class GpuPeakSampler:
    """Every visible GPU's peak device memory in use (NVML, all processes) while the block runs, sampled every
    ``interval_s`` in a thread: per GPU, for runs over several GPUs (`python -m jobs.bench compare`), and per
    process (``process_peaks_gib()``: the learner's and vLLM's engine core's whole use, their CUDA contexts
    included, which the estimate's "CUDA context" line is calibrated from). Without NVML or a GPU,
    ``peaks_gib()`` is None."""

    def __init__(self, interval_s: float = 0.25) -> None:
        import threading

        self.interval_s, self._stop, self._peaks = interval_s, threading.Event(), None
        self._procs: dict[int, int] = {}  # pid -> peak bytes NVML attributes to it
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
            self.sample()

    def sample(self) -> None:
        """One reading of every GPU and its processes into the peaks."""
        for i, h in enumerate(self._handles):
            self._peaks[i] = max(self._peaks[i], self._nvml.nvmlDeviceGetMemoryInfo(h).used)
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:  # not supported here (some containers): the device's peak still counts
                continue
            for proc in procs:
                used = proc.usedGpuMemory or 0  # None where the driver does not say
                self._procs[proc.pid] = max(self._procs.get(proc.pid, 0), used)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peaks_gib(self) -> list[float] | None:
        return None if not self._peaks else [b / GIB for b in self._peaks]

    def process_peaks_gib(self) -> list[dict[str, Any]]:
        """Each GPU process seen, largest peak first: NVML's pid and the peak in GiB. The pid is NVML's, which in a
        container can be the host's: it names no process here (on the GPU machine one such pid matched an
        unrelated local process), so no command is looked up; alone on the GPU, a job's two largest are vLLM's
        engine core and the learner."""
        ranked = sorted(self._procs.items(), key=lambda kv: -kv[1])
        return [{"pid": pid, "peak_gib": peak / GIB} for pid, peak in ranked]


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
    for proc in r.get("gpu_process_peaks") or []:
        print(f"GPU process {proc['pid']} (NVML's pid): peak {proc['peak_gib']:.2f} GiB")
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
