"""Summarise GSPO/GRPO run directories of the CPU tic-tac-toe study (docs/results-cpu.md, "Short-run study").

    .venv/bin/python scripts/ttt_study_summary.py /tmp/ttt-study/g-base /tmp/ttt-study/g-grpo ...
    .venv/bin/python scripts/ttt_study_summary.py --curve 10 /tmp/ttt-study/g-base   # 10-step means

Per run: steps, GSPO wall time (sum of time/step), mean step time, reward / legal / occupied / parse-error
fractions of the first and last `--window` steps, mean zero-variance group fraction, grad norm and clip fraction
over the last window, and the held-out (greedy) legal and optimal rates at start and end (eval.jsonl).
"""
import argparse, json, sys
from pathlib import Path

LEGAL = ("error/legal_suboptimal", "error/optimal", "error/win")


def load(run):
    rows = [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rows = [r for r in rows if "rollout/rewards_mean" in r]
    evals = {}
    ep = Path(run) / "eval.jsonl"
    if ep.exists():
        for l in ep.read_text().splitlines():
            if l.strip():
                e = json.loads(l)
                evals[e.get("tag", e.get("when", len(evals)))] = e
    return rows, evals


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def col(rows, k):
    if k == "legal":
        return [sum(r.get(x, 0.0) for x in LEGAL) for r in rows]
    return [r.get(k) for r in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--curve", type=int, default=0)
    a = ap.parse_args()
    w = a.window
    hdr = ("run", "steps", "wall_s", "s/step", "rew_f", "rew_l", "d_rew", "legal_f", "legal_l", "occ_l", "parse_l",
           "zvar_l", "gnorm_l", "clip_l", "ho_legal0", "ho_legal1", "ho_opt1")
    print(" | ".join(hdr))
    for run in a.runs:
        rows, evals = load(run)
        if not rows:
            print(run, "no steps"); continue
        f, l = rows[:w], rows[-w:]
        wall = sum(r.get("time/step", 0.0) for r in rows)
        ev = list(evals.values())
        def ho(e, k):
            for key in (f"eval/{k}", k):
                if key in e: return e[key]
            return float("nan")
        e0 = ev[0] if ev else {}
        e1 = ev[-1] if len(ev) > 1 else {}
        vals = (Path(run).name, len(rows), f"{wall:.0f}", f"{wall/len(rows):.1f}",
                f"{mean(col(f,'rollout/rewards_mean')):.3f}", f"{mean(col(l,'rollout/rewards_mean')):.3f}",
                f"{mean(col(l,'rollout/rewards_mean'))-mean(col(f,'rollout/rewards_mean')):+.3f}",
                f"{mean(col(f,'legal')):.3f}", f"{mean(col(l,'legal')):.3f}",
                f"{mean(col(l,'error/occupied')):.3f}", f"{mean(col(l,'error/parse_error')):.3f}",
                f"{mean(col(l,'adv/zero_var_group_frac')):.2f}", f"{mean(col(l,'train/grad_norm')):.3f}",
                f"{mean(col(l,'train/clip_frac')):.3f}",
                f"{ho(e0,'legal_move_rate'):.3f}", f"{ho(e1,'legal_move_rate'):.3f}", f"{ho(e1,'optimal_move_rate'):.3f}")
        print(" | ".join(str(v) for v in vals))
        if a.curve:
            for i in range(0, len(rows), a.curve):
                c = rows[i:i + a.curve]
                print(f"   steps {i+1:4d}-{i+len(c):4d}: reward {mean(col(c,'rollout/rewards_mean')):+.3f} legal "
                      f"{mean(col(c,'legal')):.3f} occ {mean(col(c,'error/occupied')):.3f} parse "
                      f"{mean(col(c,'error/parse_error')):.3f} zvar {mean(col(c,'adv/zero_var_group_frac')):.2f} "
                      f"gnorm {mean(col(c,'train/grad_norm')):.3f} clip {mean(col(c,'train/clip_frac')):.3f}")


if __name__ == "__main__":
    main()
