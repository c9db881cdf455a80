"""Per-step metrics: computed from trajectory summaries, learner stats and phase timings, written to
`<run_dir>/metrics.jsonl` (one object per step) and TensorBoard under the same names, and to the sinks the driver
adds (Ray gauges; the W&B and MLflow trackers of rlsys/trackers.py).

Names follow AReno's where they exist: rollout/rewards_mean, rollout/response_len_mean, time/rollout...
The error table is `error/<outcome>` (fractions of the batch, failed trajectories included under
`error/<failure kind>`), so a broken episode is counted, never disguised as a 0 reward.
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlsys.types import TrajectorySummary


class Timer:
    """`with timer("rollout"):` accumulates seconds under `time/rollout` (SkyRL's Timer, trimmed)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time/{name}"] = self.seconds.get(f"time/{name}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def failure_kind(reason: str) -> str:
    """`"agent_timeout: after 60 s"` -> `"agent_timeout"`."""
    return reason.split(":", 1)[0].strip() or "unknown"


def episode_label(summary: TrajectorySummary) -> str:
    """The row of the error table an episode counts in: its failure kind, else its outcome ("unlabelled" when the
    environment gave none)."""
    return failure_kind(summary.fail_reason) if summary.failed else (summary.outcome or "unlabelled")


def rollout_metrics(summaries: Iterable[TrajectorySummary], outcome_labels: Iterable[str] = ()) -> dict[str, float]:
    """Reward, length and error-table fractions of one rollout batch: of every trajectory in ``summaries``. The
    training driver passes every trajectory it sampled, the groups dynamic sampling dropped included (the
    `rollout/groups_*` counts, rlsys/sampling.py, say how many were kept); what the learner saw is under `adv/`.

    ``outcome_labels`` are always reported (as 0.0 when absent) so TensorBoard curves do not start late.
    """
    summaries = list(summaries)
    n = len(summaries)
    valid = [s for s in summaries if not s.failed]
    out: dict[str, float] = {
        "rollout/num_trajectories": float(n),
        "rollout/failed_frac": (n - len(valid)) / n if n else 0.0,
    }
    if valid:
        rewards = [s.reward for s in valid]
        mean = sum(rewards) / len(rewards)
        out["rollout/rewards_mean"] = mean
        out["rollout/rewards_std"] = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        out["rollout/rewards_max"] = max(rewards)
        out["rollout/rewards_min"] = min(rewards)
        out["rollout/response_len_mean"] = sum(s.response_len for s in valid) / len(valid)
        out["rollout/num_turns_mean"] = sum(s.num_turns for s in valid) / len(valid)
    # turns that did not extend their session's tokens (re-tokenisation drift, edited history): a new segment
    breaks = sum(s.segment_breaks for s in summaries)
    out["rollout/segment_breaks"] = float(breaks)
    out["rollout/segment_break_rate"] = breaks / max(1, sum(max(s.num_turns - 1, 0) for s in summaries))
    # later turns: prompt continued from the recorded ids vs re-rendered from the messages (rlsys/proxy)
    out["rollout/prompt_from_ids"] = float(sum(s.prompt_from_ids for s in summaries))
    out["rollout/re_rendered"] = float(sum(s.re_rendered for s in summaries))
    # answers cut at max_tokens: a growing fraction is the first sign of the length collapse (docs/results.md)
    out["rollout/truncated_frac"] = sum(s.truncated_turns > 0 for s in summaries) / n if n else 0.0
    counts = Counter(episode_label(s) for s in summaries)
    for label in outcome_labels:
        counts.setdefault(label, 0)
    for label, count in sorted(counts.items()):
        out[f"error/{label}"] = count / n if n else 0.0
    # the environment's per-episode scalars (`Environment.episode_metrics`), each averaged over the valid
    # episodes that report it
    for key in sorted({k for s in valid for k in s.metrics}):
        values = [s.metrics[key] for s in valid if key in s.metrics]
        out[f"episode/{key}"] = sum(values) / len(values)
    return out


def failure_lines(summaries: Sequence[TrajectorySummary], limit: int = 3) -> list[str]:
    """The step's failed episodes, most common reason first (the metrics keep only their kind): what a person
    watching the job needs to fix an agent, a reward or the proxy. Up to ``limit`` distinct reasons."""
    reasons = Counter(s.fail_reason or "unknown" for s in summaries if s.failed)
    lines = [f"  {count} failed: {reason}" for reason, count in reasons.most_common(limit)]
    if len(reasons) > limit:
        lines.append(f"  ... and {sum(reasons.values()) - sum(c for _, c in reasons.most_common(limit))} more "
                     f"({len(reasons) - limit} other reasons)")
    return lines


class MetricsLogger:
    """metrics.jsonl + TensorBoard. Values that are not finite numbers are kept in JSON as strings."""

    def __init__(self, run_dir: str | Path, tb_dir: str | Path | None, start_step: int = 0,
                 sinks: Iterable[Any] = ()) -> None:
        """Rows of steps >= ``start_step`` already in the run directory are dropped from the JSONL files and
        TensorBoard: a resumed run redoes the steps the crashed run logged after its last checkpoint, and
        a fresh run (start_step 0) in an old run directory starts the files anew."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "eval.jsonl"):
            _truncate_from(self.path.with_name(name), start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._eval_file = None
        # anything with log(step, metrics), and optionally log_eval(step, tag, metrics) and close(): Ray gauges
        # for the dashboard, the experiment trackers (rlsys/trackers.py)
        self._sinks = list(sinks)
        self._tb = None
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tb_dir), purge_step=start_step or None)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._write(self._file, step, metrics)
        for sink in self._sinks:
            sink.log(step, metrics)

    def log_eval(self, step: int, tag: str, metrics: dict[str, Any]) -> None:
        """Held-out evaluation: `<run_dir>/eval.jsonl` (with its tag) and TensorBoard under eval/*."""
        if self._eval_file is None:
            self._eval_file = self.path.with_name("eval.jsonl").open("a", encoding="utf-8")
        self._write(self._eval_file, step, {"tag": tag, **metrics})
        for sink in self._sinks:
            if hasattr(sink, "log_eval"):
                sink.log_eval(step, tag, metrics)

    def _write(self, file: Any, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        file.write(json.dumps(record) + "\n")
        file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._eval_file is not None:
            self._eval_file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:  # a tracker marks its run failed when this runs while an exception propagates
            if hasattr(sink, "close"):
                sink.close()


def _truncate_from(path: Path, start_step: int) -> None:
    if not path.is_file():
        return
    rows = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [r for r in rows if 0 <= _step_of(r) < start_step]
    if len(kept) != len(rows):
        path.write_text("".join(kept), encoding="utf-8")


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1  # a torn last line from a crash: dropped


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def console_line(step: int, max_steps: int, m: dict[str, Any]) -> str:
    """One line per step: what a person watching the job wants to see. With the rollout phase's group counts
    (`Job.rollout_until_full`): groups kept of sampled, the zero-variance fraction before the filter, rounds."""
    def g(key: str, fmt: str = "{:.3f}") -> str:
        v = m.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    groups = (f"  groups {g('rollout/groups_kept', '{:.0f}')}/{g('rollout/groups_sampled', '{:.0f}')} (zero-var "
              f"{g('rollout/zero_var_group_frac', '{:.2f}')}, {g('rollout/sample_rounds', '{:.0f}')} rnd)"
              if "rollout/groups_sampled" in m else "")
    return (
        f"step {step + 1}/{max_steps}  reward {g('rollout/rewards_mean')}  len {g('rollout/response_len_mean', '{:.1f}')}"
        f"  failed {g('rollout/failed_frac', '{:.2f}')}{groups}  loss {g('train/loss', '{:.4f}')}"
        f"  |dlogp| {g('train/logp_diff_mean', '{:.2e}')}  gnorm {g('train/grad_norm', '{:.2f}')}"
        f"  {g('time/step', '{:.1f}')}s (rollout {g('time/rollout', '{:.1f}')}, train {g('time/train', '{:.1f}')},"
        f" sync {g('time/sync', '{:.2f}')})  {g('perf/tokens_per_s', '{:.0f}')} tok/s"
    )
