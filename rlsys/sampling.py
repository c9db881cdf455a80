"""Dynamic sampling (DAPO's group filter), as pure bookkeeping over the driver's trajectory summaries.

A group (the `n_samples` episodes of one board) whose valid rewards all agree gets advantage 0 for every member
(rlsys/algos/advantages.py): it costs a forward/backward and teaches nothing. Under `algo.dynamic_sampling` the
rollout phase (`jobs.job.Job.rollout_until_full`) drops such groups and samples more boards until the batch
holds `rollout.batch_size` groups with signal or `algo.max_sample_rounds` rounds were sampled:

    sieve = GroupSieve(want=batch_size, ...)
    boards = batch_size
    while boards:                                   # one round: all its boards x samples submitted at once
        summaries = sample(next boards)             # group ids continue across rounds (`sieve.groups_seen`)
        sieve.add(summaries)
        boards = sieve.next_round()                 # 0: full, or the cap was hit
    train on the groups in sieve.kept()             # at most batch_size; the surplus is dropped, counted

The first round is sized by the share of groups with signal in recent steps (`next_signal_rate`: boards = batch_size /
share), a top-up round by the shortfall and the keep rate seen so far this step (boards = missing groups / keep
rate), each at most `algo.max_oversample` boards per group, so a step of mostly settled boards usually fills in
its first round, and otherwise needs one extra round, not one round trip per group.

"Valid" is the learner's own definition, so that a kept group has signal in the advantage code too: not failed, a
non-empty response, and (under `algo.mask_truncated`) no turn cut at `max_new_tokens`. A group with fewer than two
valid members has no signal. The rewards compared are the learner's too (`training_reward`: less
`algo.truncated_penalty` for a cut-off answer). Departures from DAPO/verl, on purpose: verl raises once
`max_num_gen_batches` is reached; here the step trains on what was kept (and skips the update when nothing was).
The surplus of the last round is dropped in sampling order (earlier rounds and lower group ids first), not at
random. With `algo.unanimous_groups` (for `algo.unanimous_baseline = "batch"`), up to that many unanimous groups
that have a valid member are kept besides, also in sampling order; under `"batch_below"` the lowest-rewarded first
(the ones its baseline can push down); `algo.unanimous_pick = "mixed"`: half the lowest-rewarded, half in sampling
order.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class _Summary(Protocol):  # rlsys.types.TrajectorySummary's fields read here
    group: int
    reward: float
    failed: bool
    response_len: int
    truncated_turns: int


def is_valid(s: _Summary, mask_truncated: bool = False) -> bool:
    """Whether the learner's advantage code counts this trajectory in its group's baseline (actors/learner.py)."""
    return not s.failed and s.response_len > 0 and not (mask_truncated and s.truncated_turns > 0)


def training_reward(s: _Summary, truncated_penalty: float = 0.0) -> float:
    """The reward the advantages see: the environment's, less ``truncated_penalty`` (`algo.truncated_penalty`) when
    a turn was cut at `max_new_tokens`."""
    return float(s.reward) - (truncated_penalty if s.truncated_turns > 0 else 0.0)


def valid_rewards(summaries: Iterable[_Summary], mask_truncated: bool = False,
                  truncated_penalty: float = 0.0) -> dict[int, list[float]]:
    """Group id -> the training rewards of its valid members (none for a group without one), in the order the
    groups first appear."""
    rewards: dict[int, list[float]] = {}
    for s in summaries:
        mine = rewards.setdefault(s.group, [])
        if is_valid(s, mask_truncated):
            mine.append(training_reward(s, truncated_penalty))
    return rewards


def has_signal(rewards: list[float]) -> bool:
    """Whether a group's valid rewards carry a learning signal: at least two, and not all equal."""
    return len(rewards) >= 2 and min(rewards) != max(rewards)


def group_signal(summaries: Iterable[_Summary], mask_truncated: bool = False,
                 truncated_penalty: float = 0.0) -> dict[int, bool]:
    """Group id -> whether the group carries a learning signal (>= 2 valid members whose training rewards differ),
    in the order the groups first appear."""
    return {g: has_signal(r) for g, r in valid_rewards(summaries, mask_truncated, truncated_penalty).items()}


def top_up_boards(missing: int, kept: int, sampled: int, max_oversample: float) -> int:
    """Boards for the next round: ``missing`` groups at the keep rate seen so far (``kept`` of ``sampled``
    groups), at most ``max_oversample`` boards per missing group (also the rate assumed when nothing was kept)."""
    if missing <= 0:
        return 0
    rate = max(kept / sampled if sampled else 1.0, 1.0 / max_oversample)
    return max(missing, math.ceil(missing / rate - 1e-9))


@dataclass
class GroupSieve:
    """One step's dynamic-sampling state: which groups were sampled and kept, and how many boards to sample next.

    With ``enabled`` False every group is kept and there is a single round (the counts are still reported)."""

    want: int  # groups with signal the batch needs (`rollout.batch_size`)
    max_rounds: int = 1  # `algo.max_sample_rounds`: rounds of sampling per step, the first included
    max_oversample: float = 4.0  # `algo.max_oversample`: at most this many boards per missing group in a top-up
    mask_truncated: bool = False  # `algo.mask_truncated`: cut-off trajectories are not valid members
    truncated_penalty: float = 0.0  # `algo.truncated_penalty`: less reward for cut-off trajectories
    enabled: bool = True
    unanimous: int = 0  # `algo.unanimous_groups`: unanimous groups kept besides the `want` with signal
    unanimous_pick: str = "first"  # `algo.unanimous_pick` (`AlgoConfig.unanimous_order`): first | lowest | mixed
    rounds: int = 0
    groups_seen: int = 0  # groups sampled so far; the next round's group ids start here
    zero_var: int = 0  # sampled groups without signal
    with_signal: list[int] = field(default_factory=list)  # group ids with signal, in sampling order
    _kept: list[int] = field(default_factory=list)  # group ids kept, in sampling order (may exceed `want`)
    # groups without signal that have a valid member -> their one training reward, in sampling order
    _unanimous: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unanimous_pick not in ("first", "lowest", "mixed"):
            raise ValueError(f"GroupSieve: unanimous_pick must be first, lowest or mixed, got {self.unanimous_pick!r}")

    def add(self, summaries: Iterable[_Summary]) -> None:
        """One round's summaries (all its groups, every member)."""
        rewards = valid_rewards(summaries, self.mask_truncated, self.truncated_penalty)
        signal = {g: has_signal(r) for g, r in rewards.items()}
        self._unanimous.update({g: r[0] for g, r in rewards.items() if r and not signal[g]})
        self.rounds += 1
        self.groups_seen += len(signal)
        self.zero_var += sum(not s for s in signal.values())
        self.with_signal += [g for g, s in signal.items() if s]
        self._kept += [g for g, s in signal.items() if s or not self.enabled]

    def first_round(self, signal_rate: float = 1.0) -> int:
        """Boards for the step's first round: ``want`` groups at ``signal_rate``, the share of groups with signal in
        recent steps (`next_signal_rate`), at most ``max_oversample`` boards per group; ``want`` with filtering off. Sized
        up front, a step whose boards mostly settled fills in one round instead of waiting for a top-up."""
        if not self.enabled:
            return self.want
        return top_up_boards(self.want, signal_rate, 1.0, self.max_oversample)

    def next_round(self) -> int:
        """Boards to sample in the next round; 0 when the batch is full, the cap was hit or filtering is off."""
        if not self.enabled or self.rounds >= self.max_rounds:
            return 0
        return top_up_boards(self.want - len(self._kept), len(self._kept), self.groups_seen, self.max_oversample)

    def kept(self) -> set[int]:
        """The group ids to train on: the first ``want`` kept, in sampling order (and with ``unanimous`` that many
        unanimous groups, by ``unanimous_pick``: the first sampled; the lowest-rewarded, ties in sampling order; or
        ``mixed``, half of them (rounded up) the lowest-rewarded and the rest the first sampled of the others)."""
        if not self.enabled:
            return set(self._kept[: self.want])
        candidates = list(self._unanimous)  # sampling order
        if self.unanimous_pick != "first":
            lowest = sorted(candidates, key=self._unanimous.__getitem__)  # sorted() is stable: ties in sampling order
            if self.unanimous_pick == "lowest":
                candidates = lowest
            else:  # mixed: the lowest half (rounded up), then the rest in sampling order
                head = lowest[: (self.unanimous + 1) // 2]
                taken = set(head)
                candidates = head + [g for g in candidates if g not in taken]
        return set(self._kept[: self.want]) | set(candidates[: self.unanimous])

    def signal_share(self) -> float | None:
        """This step's share of sampled groups with signal (None before any round)."""
        return len(self.with_signal) / self.groups_seen if self.groups_seen else None

    def metrics(self) -> dict[str, float]:
        """`rollout/groups_sampled`, `rollout/groups_kept` (what the learner gets), `rollout/groups_surplus` (had
        signal, dropped beyond `batch_size`), `rollout/zero_var_group_frac` (of the sampled groups, before the
        filter: the learner's `adv/zero_var_group_frac` is the same measure after it), `rollout/sample_rounds`; with
        ``unanimous``, `rollout/groups_unanimous_kept` (on top of `groups_kept`)."""
        kept = min(len(self._kept), self.want)
        out = {"rollout/groups_sampled": float(self.groups_seen), "rollout/groups_kept": float(kept),
               "rollout/groups_surplus": float(len(self._kept) - kept),
               "rollout/zero_var_group_frac": self.zero_var / self.groups_seen if self.groups_seen else 0.0,
               "rollout/sample_rounds": float(self.rounds)}
        if self.unanimous and self.enabled:
            out["rollout/groups_unanimous_kept"] = float(min(len(self._unanimous), self.unanimous))
        return out



def next_signal_rate(rate: float, share: float | None, alpha: float = 0.3) -> float:
    """The share of groups with signal over recent steps, an exponential moving average with weight ``alpha`` on
    this step's ``share`` (None: no round sampled, unchanged). It sizes the next step's first round
    (`GroupSieve.first_round`) and is saved with the data cursor (`ItemStream.signal_rate`), so a resumed run draws
    as many boards as the uninterrupted one would."""
    return rate if share is None else (1 - alpha) * rate + alpha * share
