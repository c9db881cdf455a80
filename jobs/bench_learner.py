"""`python -m jobs.bench learner`: the learner alone on synthetic batches (jobs/bench.py says what it reports)."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from jobs.bench_models import model_ckpt


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

    from actors.learner import Learner
    from actors.reference import Reference
    from jobs.placement import learner_settings
    from rlsys.config import load_config
    from rlsys.models.resolve import resolve_model

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
        settings = learner_settings(cfg, model_path)
        learner = Learner(settings, model_path)
        if cfg.learner.reference_actor:  # as in the job: the batches carry the reference's logprobs, run apart
            reference = Reference(settings)
            for batch in batches:
                reference.annotate(*batch)  # fills the segments in place
            del reference
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
