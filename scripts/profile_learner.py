"""Where the learner's time goes on gsm-shaped batches (issue 24, item 3): a probe, not a benchmark.

The learner of `configs/gsm-qwen0.5b.toml` (LoRA r=16 on a bf16 base, micro-batches of 4; prefix sharing on in the
`sharing` variant, the config's until 2026-12-04, off in the config now) on a random
Qwen2.5-0.5B-shaped model (jobs.bench's `qwen0.5b-random`), fed synthetic batches shaped as a gsm step: 8 problems x
8 samples, a 450-token prompt per problem, two sampled turns around a 20-token tool result, 200-400 tokens after the
prompt. Each variant: one `Learner.train` call to warm up, one timed (tokens/s over the input tokens); then one call
of the config's learner (`recipe`) under torch.profiler, its top operators by CUDA and by CPU time. JSON lines go to
OUT/profile.jsonl as they come, so a cut run still says what it measured.

    python scripts/profile_learner.py --out DIR [--variants recipe,sharing,mbs16,full] [--model qwen0.5b-random]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

VARIANTS = {
    "recipe": [],  # the config's learner: no prefix sharing since 2026-12-04 (twelfth session)
    "sharing": ["learner.prefix_sharing=true"],
    "no-sharing": ["learner.prefix_sharing=false"],
    "mbs16": ["learner.prefix_sharing=true", "learner.mini_bs=16"],
    "tok16k": ["learner.prefix_sharing=true", "learner.micro_batch_tokens=16384"],
    "full": ["learner.lora.enabled=false", "learner.lr=5e-6"],
}


def batch(vocab: int, seed: int, groups: int = 8, samples: int = 8, prompt_len: int = 450,
          first: tuple[int, int] = (100, 250), tool: int = 20, second: tuple[int, int] = (80, 130)):
    """Trajectories shaped as one gsm step (rewards 0/1 with both in every group: every row has an advantage): a
    prompt, then each answer's two sampled turns (``first``, ``second``: token ranges) around a ``tool`` result."""
    from rlsys.types import Segment, Trajectory

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    out = []
    for g in range(groups):
        prompt = ids(prompt_len)
        for s in range(samples):
            a, b = rng.randint(*first), rng.randint(*second)
            toks = prompt + ids(a) + ids(tool) + ids(b)
            mask = [0] * prompt_len + [1] * a + [0] * tool + [1] * b
            seg = Segment(toks, mask, [-1.0 if m else 0.0 for m in mask])
            out.append(Trajectory(item_id=f"p{g}", group=g, sample=s, segments=[seg], reward=float(s % 2),
                                  num_turns=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="recipe,sharing,mbs16,full")
    p.add_argument("--model", default="qwen0.5b-random")
    p.add_argument("--config", default="configs/gsm-qwen0.5b.toml")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    import torch

    from actors.learner import Learner
    from jobs.bench_models import model_folder
    from jobs.placement import learner_settings
    from rlsys.config import load_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "profile.jsonl").open("a")

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    t0 = time.perf_counter()
    folder = str(model_folder(args.model, Path("/tmp/rlsys-cache/bench") if torch.cuda.is_available()
                              else out / "models"))
    emit({"event": "model", "folder": folder, "s": round(time.perf_counter() - t0, 1)})
    for name in args.variants.split(","):
        cpu = [] if torch.cuda.is_available() else ["learner.adam_8bit=false"]  # a CPU smoke run
        cfg = load_config(args.config, overrides=["logging.progress=false", *VARIANTS[name], *cpu])
        learner = Learner(learner_settings(cfg, folder), folder)
        trajs = batch(int(learner.model.config.vocab_size), seed=0)
        tokens = sum(len(t.segments[0].input_ids) for t in trajs)
        times = []
        for _ in range(2):  # the first warms up kernels and the allocator
            t = time.perf_counter()
            stats = learner.train(trajs)
            times.append(time.perf_counter() - t)
        rec = {"event": "variant", "variant": name, "overrides": VARIANTS[name], "input_tokens": tokens,
               "warmup_s": round(times[0], 3), "train_s": round(times[1], 3),
               "tokens_per_s": round(tokens / times[1]), "prefix_saved_frac": stats.get("train/prefix_saved_frac"),
               "peak_gib": stats.get("mem/learner_peak_allocated_gib"), "grad_norm": stats.get("train/grad_norm")}
        emit(rec)
        if name == "recipe" and not args.no_profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                t = time.perf_counter()
                learner.train(trajs)
                wall = time.perf_counter() - t
            avg = prof.key_averages()
            cuda_attr = ("self_device_time_total" if hasattr(avg[0], "self_device_time_total")
                         else "self_cuda_time_total")
            cuda_total = sum(getattr(e, cuda_attr, 0) for e in avg) / 1e6
            emit({"event": "profile", "variant": name, "wall_s": round(wall, 3), "self_cuda_s": round(cuda_total, 3),
                  "self_cpu_s": round(sum(e.self_cpu_time_total for e in avg) / 1e6, 3)})
            for key, sort in (("by_cuda", cuda_attr), ("by_cpu", "self_cpu_time_total")):
                top = sorted(avg, key=lambda e: getattr(e, sort, 0), reverse=True)[:25]
                emit({"event": key, "ops": [[e.key[:80], e.count, round(getattr(e, sort, 0) / 1e3, 1)] for e in top]})
            (out / "profile.txt").write_text(avg.table(sort_by=cuda_attr, row_limit=40))
        del learner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
