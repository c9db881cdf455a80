"""What dynamic sampling's caps buy when few boards have signal: rlsys/sampling.py's `GroupSieve` on simulated steps.

    python scripts/sim_dynamic_sampling.py                      # the GPU recipe's shape, p = 3%, 5%, 7%
    python scripts/sim_dynamic_sampling.py --p 0.05 --caps 8:3 16:3 32:3

Each board of a step has signal (its samples' rewards differ) with probability p, independently; the sieve sizes
the rounds as in a job (the first by the moving signal rate, `next_signal_rate`; top-ups by the keep rate), with
`--want` groups wanted, `--samples` answers a board and each cap `MAX_OVERSAMPLE:MAX_ROUNDS`. Per cap: groups with
signal kept a step, the share of steps short of `--want`, boards and answers sampled, rounds, and under a step-cost
model (`--round-s` a round + `--token-s` per generated token x `--answer-tokens`, plus `--rest-s` for the learner
and the rest; the defaults are the GPU recipe's fit of 2026-12-06, docs/results.md) the step time and groups with
signal a second. No model, no Ray: seconds on a CPU.
"""
from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from rlsys.sampling import GroupSieve, next_signal_rate


@dataclass
class _Episode:  # the fields GroupSieve reads of a trajectory summary
    group: int
    reward: float
    failed: bool = False
    response_len: int = 20
    truncated_turns: int = 0


def simulate(p: float, max_oversample: float, max_rounds: int, *, want: int = 4, samples: int = 8, steps: int = 3000,
             seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    rate, kept, boards_a_step, rounds = p, [], [], []
    for _ in range(steps):
        sieve = GroupSieve(want=want, max_rounds=max_rounds, max_oversample=max_oversample)
        boards, total = sieve.first_round(rate), 0
        while boards:
            episodes = []
            for b in range(boards):
                group, signal = sieve.groups_seen + b, rng.random() < p
                episodes += [_Episode(group, float(j == 0) if signal else 0.5) for j in range(samples)]
            total += boards
            sieve.add(episodes)
            boards = sieve.next_round()
        rate = next_signal_rate(rate, sieve.signal_share())
        m = sieve.metrics()
        kept.append(m["rollout/groups_kept"])
        rounds.append(m["rollout/sample_rounds"])
        boards_a_step.append(total)
    return {"kept": statistics.fmean(kept), "short": sum(k < want for k in kept) / len(kept),
            "boards": statistics.fmean(boards_a_step), "answers": samples * statistics.fmean(boards_a_step),
            "rounds": statistics.fmean(rounds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, nargs="+", default=[0.03, 0.05, 0.07], help="share of boards with signal")
    ap.add_argument("--caps", nargs="+", default=["8:3", "16:3", "24:3", "8:4", "16:4"],
                    help="MAX_OVERSAMPLE:MAX_ROUNDS pairs")
    ap.add_argument("--want", type=int, default=4, help="rollout.batch_size")
    ap.add_argument("--samples", type=int, default=8, help="rollout.n_samples")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--round-s", type=float, default=0.1)
    ap.add_argument("--token-s", type=float, default=0.09e-3)
    ap.add_argument("--answer-tokens", type=float, default=26.0)
    ap.add_argument("--rest-s", type=float, default=0.62)
    args = ap.parse_args(argv)
    print("| p | max_oversample | max_sample_rounds | groups kept | steps short | boards | answers | rounds | "
          "step s (model) | groups with signal a second |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in args.p:
        for cap in args.caps:
            oversample, rounds = cap.split(":")
            r = simulate(p, float(oversample), int(rounds), want=args.want, samples=args.samples, steps=args.steps)
            step_s = args.round_s * r["rounds"] + args.token_s * args.answer_tokens * r["answers"] + args.rest_s
            print(f"| {p:g} | {oversample} | {rounds} | {r['kept']:.2f} | {r['short']:.2f} | {r['boards']:.1f} | "
                  f"{r['answers']:.0f} | {r['rounds']:.2f} | {step_s:.2f} | {r['kept'] / step_s:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
