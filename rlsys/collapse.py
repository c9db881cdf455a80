"""The collapse check: a policy that answers every sampled item the same way in every group has nothing left to
learn from (GSPO/GRPO advantages are 0). The driver counts it each step (`CollapseWatch.update`, jobs/train.py) and
`rlsys report` replays the same count on a run's metrics (`replay`), so a run of an older tree, which logged only
`rollout/zero_var_group_frac`, reads the same."""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterable


class CollapseWatch:
    """`algo.collapse_steps` and `algo.collapse_share`: the policy has collapsed once ``steps`` steps in a row had
    every group unanimous (`rollout/unanimous_streak`), or ``share`` of the last ``2 * steps`` steps had
    (`rollout/unanimous_steps`). Says so once (``say``; ``declared`` is then the count of steps seen); ``update`` is
    then True when `algo.stop_on_collapse` asks training to end. The share catches a frozen policy whose odd step
    still has a group with signal: a GPU run stuck on "the first free square" had 127 such steps of 188 but 20 in a
    row only at its last (docs/results.md, 2026-12-06, twenty-ninth session)."""

    def __init__(self, steps: int, stop: bool, share: float = 1.0,
                 say: Callable[[str], None] | None = None) -> None:
        self.steps, self.stop, self.streak = steps, stop, 0
        self.window: deque[bool] = deque(maxlen=2 * steps)
        self.need = math.ceil(share * self.window.maxlen - 1e-9)  # of the window, all unanimous
        self.say = say or (lambda line: print(line, flush=True))
        self.seen = 0  # steps counted
        self.declared: int | None = None  # the count of steps when the collapse was said
        self.how = ""  # "streak" or "share"
        self.longest = self.most = 0  # the longest streak, the most unanimous steps of a full window

    def update(self, m: dict[str, float]) -> bool:
        """Count this step's metrics ``m`` (adds `rollout/unanimous_streak` and `rollout/unanimous_steps` to them);
        True: stop training."""
        if not self.steps:
            return False
        self.seen += 1
        unanimous = m.get("rollout/zero_var_group_frac", 0.0) >= 1.0
        self.streak = self.streak + 1 if unanimous else 0
        self.window.append(unanimous)
        count = sum(self.window)
        m["rollout/unanimous_streak"], m["rollout/unanimous_steps"] = float(self.streak), float(count)
        full = len(self.window) == self.window.maxlen
        self.longest = max(self.longest, self.streak)
        self.most = max(self.most, count) if full else self.most
        by_share = full and count >= self.need
        if self.declared is not None or not (self.streak >= self.steps or by_share):
            return False
        self.declared = self.seen
        self.how = "streak" if self.streak >= self.steps else "share"
        which = f"the last {self.steps} steps" if self.how == "streak" else \
            f"{count} of the last {len(self.window)} steps"
        self.say(f"rlsys: WARNING the policy has collapsed: every group of {which} was unanimous "
                 f"(entropy {m.get('train/entropy', float('nan')):.3g}), so those steps had no advantage to learn "
                 "from. What keeps groups apart: algo.kl_coef (a penalty to the start), algo.positive_weight < 1, "
                 "algo.top_entropy_frac, algo.entropy_target (an entropy bonus that holds the entropy up), "
                 "a higher rollout.temperature, more rollout.n_samples; "
                 f"algo.stop_on_collapse=true ends such a run here{self._cut_off(m)}")
        return self.stop

    @staticmethod
    def _cut_off(m: dict[str, float]) -> str:
        """The collapse of answers that run on to the cut: groups whose answers all hit `max_new_tokens` are left
        out (`algo.mask_truncated`), so nothing would teach them to stop (four GPU runs with `batch_below`,
        docs/results.md)."""
        cut = m.get("rollout/truncated_frac", 0.0)
        if cut < 0.5:
            return ""
        return (f". {cut:.0%} of this step's answers ran on to rollout.max_new_tokens: with algo.mask_truncated "
                "they carry no signal that would shorten them; algo.truncated_penalty (instead) gives them one")


def replay(rows: Iterable[dict[str, Any]], steps: int = 20, share: float = 0.8) -> dict[str, Any] | None:
    """The collapse check over a run's logged steps (rows of metrics.jsonl, in order): ``declared_step`` (the
    logged step at which the job said, or would have said, the policy collapsed; None: never), ``how``, the
    ``longest`` streak of all-unanimous steps, the ``most`` of them in a window of ``2 * steps`` (None: fewer steps) and the
    ``unanimous`` steps in all. None for a run that logged no zero-variance fraction (SFT, or no groups) or
    ``steps`` 0 (the check off)."""
    if not steps:
        return None
    watch = CollapseWatch(steps, stop=False, share=share, say=lambda line: None)
    declared_step, unanimous = None, 0
    for row in rows:
        f = row.get("rollout/zero_var_group_frac")
        if not isinstance(f, (int, float)) or not math.isfinite(f):
            continue
        unanimous += f >= 1.0
        watch.update({"rollout/zero_var_group_frac": float(f)})
        if declared_step is None and watch.declared is not None:
            declared_step = int(row.get("step", watch.seen - 1)) + 1
    if not watch.seen:
        return None
    most = watch.most if watch.seen >= 2 * steps else None  # no full window yet
    return {"declared_step": declared_step, "how": watch.how or None, "longest": watch.longest, "most": most,
            "window": 2 * steps, "need": watch.need, "streak_limit": steps, "unanimous": unanimous,
            "steps": watch.seen}
