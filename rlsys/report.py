"""`rlsys report RUN_DIR`: a run's results at a glance, from its metrics.jsonl (and eval.jsonl), plus PNG plots.

`rlsys report RUN_DIR RUN_DIR ...`: several runs as one Markdown table, a row each (`--mean` adds their mean):
variants x seeds, as docs/results.md shows them.

Prints: steps, best and last reward, the error table's trend (mean over the first vs the last `--window` steps; the
windows overlap on runs shorter than two windows), the policy's entropy (and KL to the reference when `algo.kl_coef`
is set; with `algo.top_entropy_frac` the entropy is the selected tokens' mean, and every output says so), the mean
time per phase, dynamic sampling's work (boards sampled, the share with signal, groups kept, the steps short of
`rollout.batch_size` groups, with a hint when many are), and the held-out evaluations: the environment's rates and the
mean reward, and the collapse check (`algo.collapse_steps`, replayed on the logged steps: a run of an older tree
reads as the job would read it now). The error table follows the environment's outcome order
(`Environment.outcomes`). Writes `RUN_DIR/plots/` (or `--plots-dir DIR`): reward.png, response_len.png, loss.png,
logp_diff.png, entropy.png, step_time.png and errors.png (a plot whose metric the run did not log, e.g. logp_diff for
SFT, is skipped and said so).

Reads only files (no Ray, no TensorBoard): works on a run that is still going or was copied elsewhere, also when
its metrics.jsonl and eval.jsonl were gzipped (`.jsonl.gz`, as docs/data/ keeps them), so the commands in the docs
recompute their tables from the data that landed. Values that metrics.jsonl keeps as strings ("nan", "inf") are
read back as floats.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlsys.collapse import replay
from rlsys.envs.base import label_order

if TYPE_CHECKING:
    from rlsys.envs.base import Environment

PHASES = ("rollout", "sleep", "train", "sync", "wake", "canary")


def is_eval_rate(key: str) -> bool:
    """An evaluation's own rate or mean reward (`eval/<x>_rate`, `eval/rewards_mean`), not a perturbation's."""
    name = key.removeprefix("eval/")
    return key.startswith("eval/") and "/" not in name and (name.endswith("_rate") or name == "rewards_mean")


class ReportError(ValueError):
    """RUN_DIR is not a run directory (no metrics.jsonl) or its files cannot be read."""


@dataclass
class Run:
    path: Path
    rows: list[dict[str, Any]]  # metrics.jsonl, one per step, in file order
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval.jsonl
    config: dict[str, Any] = field(default_factory=dict)  # config.resolved.toml (empty if absent)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the steps that logged a number for it."""
        steps, values = [], []
        for r in self.rows:
            v = as_float(r.get(key))
            if v is not None:
                steps.append(int(r["step"]) + 1)  # plotted as "after step N", as the console counts
                values.append(v)
        return steps, values

    def keys(self, prefix: str) -> list[str]:
        return sorted({k for r in self.rows for k in r if k.startswith(prefix)})


def entropy_top_frac(run: Run) -> float | None:
    """The run's `algo.top_entropy_frac`: its `train/entropy` is then the mean over that share of the sampled tokens,
    the highest-entropy ones (several times the all-token mean), so it is labelled as such wherever it is shown."""
    return as_float((run.config.get("algo") or {}).get("top_entropy_frac"))


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf" as MetricsLogger writes them
        except ValueError:
            return None
    return None


def _jsonl_file(run_dir: Path, name: str) -> Path | None:
    """``run_dir/name``, else its gzipped copy ``name.gz``, else None."""
    for candidate in (run_dir / name, run_dir / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.suffix == ".gz":
        try:
            text = gzip.decompress(path.read_bytes()).decode("utf-8")
        except (OSError, EOFError) as e:  # a torn or non-gzip file: say which
            raise ReportError(f"{path}: not a readable gzip file ({e})") from None
    else:
        text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):  # the last line of a run killed mid-write may be torn: skip it
                continue
            raise ReportError(f"{path}:{n}: not JSON") from None
    return rows


def load_run(run_dir: str | Path) -> Run:
    path = Path(run_dir)
    metrics = _jsonl_file(path, "metrics.jsonl")
    if metrics is None:
        raise ReportError(f"{path}: no metrics.jsonl (is this a run directory? `rlsys train --run-dir` makes one)")
    rows = [r for r in _read_jsonl(metrics) if isinstance(r, dict) and "step" in r]
    if not rows:
        raise ReportError(f"{metrics}: no steps logged yet")
    evals_file = _jsonl_file(path, "eval.jsonl")
    evals = _read_jsonl(evals_file) if evals_file is not None else []
    config: dict[str, Any] = {}
    if (path / "config.resolved.toml").is_file():
        with (path / "config.resolved.toml").open("rb") as f:
            config = tomllib.load(f)
    return Run(path=path, rows=rows, evals=evals, config=config)


# --- the summary ------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else None


def summarize_run(run: Run, window: int = 10) -> dict[str, Any]:
    """Everything the printed report shows, as plain data (tested without printing)."""
    steps, rewards = run.series("rollout/rewards_mean")
    out: dict[str, Any] = {
        "run_dir": str(run.path), "steps": len(run.rows),
        "first_step": int(run.rows[0]["step"]) + 1, "last_step": int(run.rows[-1]["step"]) + 1,
        "algo": run.config.get("algo", {}).get("name"), "model": run.config.get("model", {}).get("ckpt"),
        "window": window, "outcomes": outcome_order(run.config), "entropy_top_frac": entropy_top_frac(run),
    }
    finite = [(s, r) for s, r in zip(steps, rewards) if math.isfinite(r)]
    if finite and out["algo"] != "sft":  # SFT episodes carry no reward (logged as 0.0)
        best_step, best = max(finite, key=lambda sr: sr[1])
        out["reward"] = {"best": best, "best_step": best_step, "last": finite[-1][1], "last_step": finite[-1][0],
                         "first_window_mean": _mean([r for _, r in finite[:window]]),
                         "last_window_mean": _mean([r for _, r in finite[-window:]])}
    first, last = run.rows[:window], run.rows[-window:]
    error_keys = [] if out["algo"] == "sft" else run.keys("error/")  # SFT examples carry no outcome
    out["errors"] = {
        key.removeprefix("error/"): {
            "first": _mean([v for r in first if (v := as_float(r.get(key))) is not None] or [0.0]),
            "last": _mean([v for r in last if (v := as_float(r.get(key))) is not None] or [0.0])}
        for key in error_keys}
    times = {}
    for key in [f"time/{p}" for p in PHASES] + [k for k in run.keys("time/") if k.removeprefix("time/") not in PHASES]:
        _, values = run.series(key)
        if values:
            times[key.removeprefix("time/")] = _mean(values)
    out["time_mean_s"] = times
    for key in ("perf/tokens_per_s", "rollout/response_len_mean", "train/loss", "train/logp_diff_mean",
                "sync/canary_logp_diff", "train/entropy", "train/kl_ref"):
        _, values = run.series(key)
        if values:
            out.setdefault("means", {})[key] = _mean(values)
            out.setdefault("lasts", {})[key] = values[-1]
    # the environment's per-episode scalars (e.g. rates by kind of item), first vs last window
    out["episode"] = {key.removeprefix("episode/"): _window_means(run, key, window) for key in run.keys("episode/")}
    out["sampling"] = sampling_summary(run, window)
    out["collapse"] = collapse_reading(run)
    out["evals"] = [{"step": e.get("step"), "tag": e.get("tag"),
                     **{k.removeprefix("eval/"): as_float(v) for k, v in e.items() if is_eval_rate(k)}}
                    for e in run.evals]
    return out


def collapse_reading(run: Run) -> dict[str, Any] | None:
    """The collapse check replayed on the run's logged steps (`rlsys.collapse.replay`) with its `algo.collapse_steps`
    and `algo.collapse_share`, the defaults where its config predates them; None for SFT (no groups)."""
    from rlsys.config import AlgoConfig

    algo, fields = run.config.get("algo", {}), AlgoConfig.model_fields
    if algo.get("name") == "sft":
        return None
    return replay(run.rows, int(algo.get("collapse_steps", fields["collapse_steps"].default)),
                  float(algo.get("collapse_share", fields["collapse_share"].default)))


SHORT_HINT_FRAC = 0.25  # the last window's share of steps short of `rollout.batch_size` groups that prints the hint


def sampling_summary(run: Run, window: int) -> dict[str, Any] | None:
    """`algo.dynamic_sampling`'s work, first vs last window: boards sampled a step, the share with signal, groups
    kept, the steps that trained on fewer than `rollout.batch_size` groups (sampling ended at
    `algo.max_sample_rounds` first) and those that used every round. None for a run without the filter (its
    config says so; without a config: no step sampled twice), whose counters only say that every group was kept."""
    kept_rows = [r for r in run.rows if as_float(r.get("rollout/groups_kept")) is not None]
    algo = run.config.get("algo", {})
    filtered = (algo["dynamic_sampling"] if "dynamic_sampling" in algo
                else any((as_float(r.get("rollout/sample_rounds")) or 0.0) > 1 for r in kept_rows))
    if not kept_rows or not filtered:
        return None
    want, cap = run.config.get("rollout", {}).get("batch_size"), algo.get("max_sample_rounds")

    def window_stats(rows: list[dict[str, Any]]) -> dict[str, float | None]:
        kept = [as_float(r["rollout/groups_kept"]) or 0.0 for r in rows]
        rounds = [v for r in rows if (v := as_float(r.get("rollout/sample_rounds"))) is not None]
        sampled = [v for r in rows if (v := as_float(r.get("rollout/groups_sampled"))) is not None]
        zero = [v for r in rows if (v := as_float(r.get("rollout/zero_var_group_frac"))) is not None]
        return {"boards_sampled": _mean(sampled), "signal_frac": None if not zero else 1.0 - _mean(zero),
                "groups_kept": _mean(kept), "rounds": _mean(rounds),
                "short_frac": None if not want else sum(k < want for k in kept) / len(kept),
                "at_cap_frac": None if not (cap and rounds) else sum(n >= cap for n in rounds) / len(rounds)}

    return {"batch_size": want, "max_sample_rounds": cap, "max_oversample": algo.get("max_oversample"),
            "first": window_stats(kept_rows[:window]), "last": window_stats(kept_rows[-window:])}


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"rlsys report: {s['run_dir']}"]
    what = ", ".join(filter(None, [s.get("algo") and f"algo {s['algo']}", s.get("model") and f"model {s['model']}"]))
    lines.append(f"  {s['steps']} steps logged (step {s['first_step']} to {s['last_step']})" + (f"; {what}" if what else ""))
    r = s.get("reward")
    if r:
        lines.append(f"  reward       best {r['best']:.3f} (step {r['best_step']}), last {r['last']:.3f} (step {r['last_step']});"
                     f" mean first {s['window']} {_fmt(r['first_window_mean'])} -> last {s['window']} {_fmt(r['last_window_mean'])}")
    elif s.get("algo") == "sft":
        lines.append("  reward       n/a (SFT has no reward; see the loss)")
    else:
        lines.append("  reward       none logged (every trajectory failed)")
    means, lasts = s.get("means", {}), s.get("lasts", {})
    for key, label, spec in (("rollout/response_len_mean", "response len", ".1f"), ("train/loss", "loss", ".4f"),
                             ("train/logp_diff_mean", "|dlogp|", ".2e"), ("train/entropy", "entropy", ".4f"),
                             ("train/kl_ref", "KL to ref", ".2e"), ("perf/tokens_per_s", "tokens/s", ".0f")):
        if key in means:
            scope = (f" (the top {s['entropy_top_frac']:g} of the sampled tokens: algo.top_entropy_frac)"
                     if key == "train/entropy" and s.get("entropy_top_frac") else "")
            lines.append(f"  {label:<12} mean {_fmt(means[key], spec)}, last {_fmt(lasts[key], spec)}{scope}")
    if s["errors"]:
        lines.append(f"  error table (fraction of trajectories)   first {s['window']}   last {s['window']}   change")
        for label, v in sorted(s["errors"].items(), key=lambda kv: label_order(kv[0], s.get("outcomes", ()))):
            lines.append(f"    {label:<36} {v['first']:>8.3f}  {v['last']:>8.3f}  {v['last'] - v['first']:>+7.3f}")
    if s.get("episode"):
        w = s["window"]
        lines.append(f"  per episode (the environment's episode_metrics), mean first {w} -> last {w}")
        for name, (a, b) in s["episode"].items():
            lines.append(f"    {name:<36} {_fmt(a):>8}  {_fmt(b):>8}")
    if s.get("sampling"):
        lines.extend(_format_sampling(s["sampling"], s["window"]))
    if s.get("collapse"):
        lines.append(_format_collapse(s["collapse"]))
    if s["time_mean_s"]:
        step = s["time_mean_s"].get("step")
        lines.append("  time per step, mean (s)" + (f": {step:.2f} in all" if step else ""))
        for phase, t in s["time_mean_s"].items():
            if phase != "step":
                share = f" ({t / step:.0%})" if step else ""
                lines.append(f"    {phase:<12} {t:>8.3f}{share}")
    if s["evals"]:
        lines.append("  held-out eval")
        for e in s["evals"]:
            shown = {k: v for k, v in e.items() if k not in ("step", "tag") and v is not None}
            rates = "  ".join(f"{k} {v:.3f}" for k, v in shown.items())
            lines.append(f"    after step {e['step']} [{e['tag']}]: {rates}")
    else:
        lines.append("  held-out eval: none in this run (eval.at_end / eval.every, or `rlsys eval --ckpt RUN_DIR`)")
    return "\n".join(lines)


def _format_sampling(d: dict[str, Any], w: int) -> list[str]:
    first, last = d["first"], d["last"]
    lines = [f"  dynamic sampling (algo.dynamic_sampling), mean first {w} -> last {w}"]
    for key, label, spec in (("boards_sampled", "boards sampled a step", ".1f"),
                             ("signal_frac", "with signal (rewards differ)", ".3f"),
                             ("rounds", "sampling rounds", ".2f"),
                             ("groups_kept", f"groups with signal kept (of {d['batch_size'] or '?'})", ".2f"),
                             ("short_frac", "steps short of them", ".2f"),
                             ("at_cap_frac", f"steps at the rounds cap ({d['max_sample_rounds'] or '?'})", ".2f")):
        lines.append(f"    {label:<36} {_fmt(first[key], spec):>8}  {_fmt(last[key], spec):>8}")
    if (last["short_frac"] or 0.0) >= SHORT_HINT_FRAC:
        lines += [f"    -> {last['short_frac']:.0%} of the last {w} steps trained on fewer groups with signal than "
                  f"rollout.batch_size (sampling stopped at",
                  f"       algo.max_sample_rounds = {d['max_sample_rounds']}). Larger caps (algo.max_oversample, now "
                  f"{d['max_oversample']}; max_sample_rounds) fill the batch with",
                  "       longer steps, at about the same groups with signal a second; more signal needs more boards "
                  "with it",
                  "       (data.signal_replay, exploration) or algo.unanimous_groups."]
    return lines


def _format_collapse(c: dict[str, Any]) -> str:
    """The collapse check's reading (`rlsys.collapse.replay`) in one line."""
    seen = (f"{c['unanimous']} of {c['steps']} steps had every group unanimous; longest streak {c['longest']}"
            + ("" if c["most"] is None else f", most in {c['window']} steps {c['most']}"))
    if c["declared_step"] is None:
        return (f"  collapse check: not declared ({seen}; it needs {c['streak_limit']} in a row or {c['need']} of "
                f"{c['window']}: algo.collapse_steps, algo.collapse_share)")
    rule = f"{c['streak_limit']} in a row" if c["how"] == "streak" else f"{c['need']} of the last {c['window']}"
    return (f"  collapse check: COLLAPSED at step {c['declared_step']} ({rule}; {seen}). "
            "The WARNING in the job's log names the settings that keep groups apart")


# --- several runs side by side ----------------------------------------------------------------------
def _window_means(run: Run, key: str, window: int) -> tuple[float | None, float | None]:
    """Mean of ``key`` over the first and the last ``window`` steps, of those that logged it (None: none did, e.g.
    the entropy of steps without an update)."""
    def over(rows: list[dict[str, Any]]) -> float | None:
        return _mean([v for r in rows if (v := as_float(r.get(key))) is not None])
    return over(run.rows[:window]), over(run.rows[-window:])


def _wall_s(run: Run, step_s: list[float], evals: list[dict[str, float | None]]) -> float | None:
    """The run's seconds from its command to the end of its last eval, from what it logged: the start-up (the
    first row's `startup/job_ready_s`), every step's `time/step` and every eval's `time/eval`. None without the
    start-up (a resumed or older run)."""
    ready = as_float(run.rows[0].get("startup/job_ready_s")) if run.rows else None
    if ready is None:
        return None
    return ready + sum(step_s) + sum(e.get("time/eval") or 0.0 for e in evals)


def compare_runs(runs: list[Run], window: int = 20) -> list[dict[str, Any]]:
    """One row per run for a table of variants x seeds: steps and steps with an update, the first/last-``window``
    means of reward, zero-variance group fraction (before dynamic sampling's filter), entropy and truncated
    fraction, under dynamic sampling the groups with signal a step of the last ``window`` (`sampling_summary`), the
    median step time, the step the collapse check declared a collapse at (None: never; `rlsys.collapse.replay`),
    and the held-out evaluations at the start and the end (the first and the last of eval.jsonl):
    mean reward, every rate, and the spread of the mean reward over prompt perturbations."""
    rows = []
    for run in runs:
        _, step_s = run.series("time/step")
        sampling = sampling_summary(run, window)
        collapse = collapse_reading(run)
        evals = [{k: as_float(v) for k, v in e.items()} for e in run.evals]
        start, end = (evals[0], evals[-1]) if evals else ({}, {})
        perturbed = [v for k, v in end.items() if k.startswith("eval/") and k.count("/") == 2
                     and k.endswith("/rewards_mean") and v is not None]
        rows.append({
            "run": run.path.name, "steps": len(run.rows),
            "collapsed_at": None if collapse is None else collapse["declared_step"],
            "updates": _updates(run.rows),
            "reward": _window_means(run, "rollout/rewards_mean", window),
            "zero_var": _window_means(run, "rollout/zero_var_group_frac", window),
            "entropy": _window_means(run, "train/entropy", window), "entropy_top_frac": entropy_top_frac(run),
            "truncated_last": _window_means(run, "rollout/truncated_frac", window)[1],
            "groups_kept_last": None if sampling is None else sampling["last"]["groups_kept"],
            "step_s_median": sorted(step_s)[len(step_s) // 2] if step_s else None,
            "wall_s": _wall_s(run, step_s, evals),
            "eval_steps": (start.get("step"), end.get("step")),
            "heldout": {k.removeprefix("eval/"): (start.get(k), end.get(k)) for k in end
                        if is_eval_rate(k) and end.get(k) is not None},
            "perturbed_reward": (min(perturbed), max(perturbed)) if perturbed else None,
        })
    return rows


def _updates(rows: list[dict[str, Any]]) -> int:
    """Steps whose optimizer moved the weights: a loss, no skipped batch (dynamic sampling kept nothing), and not
    every optimizer step skipped for a non-finite gradient (`train/optimizer_steps` grew; in logs without it, no
    `train/skipped_steps`)."""
    n, before = 0, None
    for r in rows:
        steps = as_float(r.get("train/optimizer_steps"))
        if as_float(r.get("train/loss")) is not None and not r.get("train/skipped_batch"):
            if steps is not None and before is not None:
                n += steps > before
            else:
                n += not as_float(r.get("train/skipped_steps"))
        before = steps if steps is not None else before
    return n


def format_comparison(rows: list[dict[str, Any]], window: int, rates: list[str] | None = None,
                      mean: bool = False) -> str:
    """A Markdown table of `compare_runs` rows (``rates``: the held-out rates shown, all by default; ``mean``: a
    last row with the mean of every number over the runs, e.g. the seeds of one variant)."""
    names = rates or list(dict.fromkeys(k for r in rows for k in r["heldout"]))
    pair = lambda ab, spec=".3f": f"{_fmt(ab[0], spec)} -> {_fmt(ab[1], spec)}"  # noqa: E731
    sampled = any(r.get("groups_kept_last") is not None for r in rows)  # a column only where dynamic sampling ran
    header = ["run", "steps", "with an update", f"reward first -> last {window}", "zero-var first -> last",
              *([f"groups with signal, last {window}"] if sampled else []),
              "entropy first -> last", f"cut off, last {window}", "median step s", "wall min",
              *[f"held-out {n.removesuffix('_rate')}" for n in names], "perturbed reward, end"]
    table = [header, ["---"] * len(header)]

    def cells(r: dict[str, Any]) -> list[str]:
        spread = r["perturbed_reward"]
        collapsed = f" (collapsed at {r['collapsed_at']})" if r.get("collapsed_at") is not None else ""
        return [r["run"], f"{r['steps']}{collapsed}", str(r["updates"]), pair(r["reward"]), pair(r["zero_var"], ".2f"),
                *([_fmt(r.get("groups_kept_last"), ".2f")] if sampled else []),
                pair(r["entropy"]) + (f" (top {r['entropy_top_frac']:g})" if r.get("entropy_top_frac") else ""),
                _fmt(r["truncated_last"], ".2f"), _fmt(r["step_s_median"], ".2f"),
                _fmt(None if r["wall_s"] is None else r["wall_s"] / 60, ".1f"),
                *[pair(r["heldout"].get(n, (None, None))) for n in names],
                "-" if spread is None else f"{spread[0]:.3f}-{spread[1]:.3f}"]

    table += [cells(r) for r in rows]
    if mean and len(rows) > 1:
        avg = lambda xs: _mean([x for x in xs if x is not None])  # noqa: E731
        both = lambda get: (avg([get(r)[0] for r in rows]), avg([get(r)[1] for r in rows]))  # noqa: E731
        spreads = [r["perturbed_reward"] for r in rows if r["perturbed_reward"]]
        table.append(cells({
            "run": f"mean of {len(rows)}", "steps": f"{avg([r['steps'] for r in rows]):.0f}",
            "updates": f"{avg([r['updates'] for r in rows]):.0f}", "reward": both(lambda r: r["reward"]),
            "zero_var": both(lambda r: r["zero_var"]), "entropy": both(lambda r: r["entropy"]),
            "truncated_last": avg([r["truncated_last"] for r in rows]),
            "groups_kept_last": avg([r.get("groups_kept_last") for r in rows]),
            "step_s_median": avg([r["step_s_median"] for r in rows]), "wall_s": avg([r["wall_s"] for r in rows]),
            "heldout": {n: both(lambda r, n=n: r["heldout"].get(n, (None, None))) for n in names},
            "perturbed_reward": (min(s[0] for s in spreads), max(s[1] for s in spreads)) if spreads else None}))
    return "\n".join("| " + " | ".join(row) + " |" for row in table)


def run_environment(config: dict[str, Any]) -> Environment | None:
    """The run's environment (its resolved config's `[env]`); None where it cannot be loaded here (a plug-in file
    that is not on this machine)."""
    from rlsys.config import EnvConfig
    from rlsys.errors import UserInputError

    try:
        return EnvConfig(**config.get("env", {})).environment()
    except (UserInputError, ValueError, ImportError):
        return None


def outcome_order(config: dict[str, Any]) -> tuple[str, ...]:
    """The outcome labels of the run's environment, in the environment's order; () where it cannot be loaded
    here: labels then sort by name."""
    env = run_environment(config)
    return env.outcomes if env is not None else ()


def moving_mean(ys: list[float], k: int) -> list[float]:
    """The mean of each value and the up to ``k - 1`` before it (the first few average what there is)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlsys report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="a run directory (has metrics.jsonl); several: one Markdown table, a row each, no plots")
    p.add_argument("--window", type=int, help="steps averaged at the start and the end (default 10; 20 with several)")
    p.add_argument("--no-plots", action="store_true", help="print the summary only")
    p.add_argument("--plots-dir", metavar="DIR", help="one run's plots go here instead of RUN_DIR/plots (a run "
                                                          "that is not yours to write to, e.g. under docs/data/)")
    p.add_argument("--json", action="store_true", help="print the summary (or the rows) as JSON")
    p.add_argument("--rates", help="with several runs: the held-out rates shown, comma-separated (default all)")
    p.add_argument("--mean", action="store_true", help="with several runs: a last row with their mean (the seeds "
                                                       "of one variant)")
    p.add_argument("--plot", metavar="PNG", help="with several runs: also write their reward, zero-variance and "
                                                "entropy curves into one PNG")
    args = p.parse_args(argv)
    several = len(args.run_dir) > 1
    window = args.window if args.window is not None else (20 if several else 10)
    if window < 1:
        p.error("--window must be at least 1")
    if several and args.plots_dir:
        p.error("--plots-dir is for one run's plots; several runs make one table (and --plot PNG)")
    if args.no_plots and args.plots_dir:
        p.error("--plots-dir with --no-plots: pick one")
    try:
        runs = [load_run(d) for d in args.run_dir]
    except (ReportError, OSError, tomllib.TOMLDecodeError) as err:
        print(f"rlsys report: {err}", file=sys.stderr)
        return 2
    if several:
        rows = compare_runs(runs, window)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()] if args.rates else None
        unknown = sorted(set(rates or ()) - {k for r in rows for k in r["heldout"]})
        if unknown:
            print(f"rlsys report: --rates: no run has {', '.join(unknown)} in its last eval", file=sys.stderr)
            return 2
        print(json.dumps(rows, indent=1) if args.json else format_comparison(rows, window, rates, args.mean))
        if args.plot:
            from rlsys.plots import write_comparison_plot

            print(f"  curves in {write_comparison_plot(runs, args.plot)}", file=sys.stderr)
        return 0
    if args.plot:
        p.error("--plot compares several runs; one run's plots go to RUN_DIR/plots")
    run = runs[0]
    summary = summarize_run(run, window)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))
    if not args.no_plots:
        from rlsys.plots import write_plots

        written, skipped = write_plots(run, args.plots_dir)
        stream = sys.stderr if args.json else sys.stdout
        where = written[0].parent if written else Path(args.plots_dir or run.path / "plots")
        print(f"  plots in {where}/: {', '.join(w.name for w in written) or 'none'}", file=stream)
        for s in skipped:
            print(f"  (skipped {s})", file=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
