"""One ledger episode over turn records, and its verdict: the agent plays it, the reward replays it.

Turn handling (the same code runs live in agent.py and again in reward.py):
    a tool-call parse error in the turn (broken JSON, an unknown tool name, bad arguments shape),
    or a call attempt in plain text the proxy did not deliver        -> 'broken_call', episode over
    no tool call                                                      -> the model's answer, episode over
    one or more calls                                                 -> each runs on the ledger, in order;
                                                                         one tool message per call
The agent also stops after `item["max_turns"]` turns (the last turn's calls still run).

Verdict, from the item and the replayed ledger only (nothing the agent or the model claims is read):
    broken_call        -1.0  the episode ended on a broken call
    no_tool_call       -1.0  the model never called a tool (e.g. it claimed success right away)
    collateral         -1.0  a ticket outside the task had its status changed (even if changed back)
    wrong_state        -1.0  a target ticket ended past its target or behind where it started
                             (e.g. closed when the task said resolved: closed is final)
    solved              1.0  every target at its target status, nothing else touched ...
    solved_with_refusals     ... minus 0.1 per refused call (illegal transition, unknown id, bad
                             arguments), at most 0.5 off
    unsolved           0.4 x (targets done / targets) - the same refusal penalty
The refusal penalty makes "try every transition until one works" worse than reading the workflow.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlsys.envs.ledger.ledger import RANK, Ledger
from rlsys.envs.ledger.prompt import TOOL_NAMES
from rlsys.envs.tictactoe_game.turns import replay_turns
from rlsys.proxy.toolcalls import parse_tool_calls

OUTCOMES = ("solved", "solved_with_refusals", "unsolved", "no_tool_call", "broken_call", "collateral", "wrong_state")
REFUSAL_PENALTY, MAX_PENALTY, PARTIAL_CREDIT = 0.1, 0.5, 0.4


def targets(item: dict) -> dict[str, str]:
    """Ticket id -> the status the task wants, computed from the item's initial tickets."""
    task = item["task"]
    if task["kind"] == "single":
        return {task["ticket"]: task["target"]}
    return {t["id"]: task["target"] for t in item["tickets"]
            if t["status"] == task["status"] and t[task["field"]] == task["value"]}


@dataclass
class Episode:
    item: dict
    ledger: Ledger
    turns: int = 0
    calls: int = 0
    end: str | None = None  # 'broken_call' | 'answered' | None while running (or cut by max_turns)
    actions: list[dict] = field(default_factory=list)  # {"name", "arguments", "ok", "changed"} per call

    @classmethod
    def start(cls, item: dict) -> "Episode":
        return cls(item=item, ledger=Ledger.from_item(item))

    @property
    def over(self) -> bool:
        return self.end is not None or self.turns >= self.item["max_turns"]

    def play_turn(self, turn: dict) -> list[tuple[str, str]] | None:
        """Apply the model's turn: (call id, tool result text) per call, or None when the episode ends."""
        if self.over:
            raise ValueError(f"episode {self.item.get('id')!r} is over; no turn can follow (agent bug)")
        self.turns += 1
        calls = turn.get("tool_calls") or []
        if turn.get("tool_call_errors") or (not calls and _has_call_attempt(turn.get("content"))):
            self.end = "broken_call"
            return None
        if not calls:
            self.end = "answered"
            return None
        results = []
        for call in calls:
            name, arguments = (call.get("name"), call.get("arguments")) if isinstance(call, dict) else (None, None)
            outcome = self.ledger.execute(name, arguments)
            self.calls += 1
            self.actions.append({"name": name, "arguments": arguments, "ok": outcome.ok, "changed": outcome.changed})
            results.append((call.get("id", "") if isinstance(call, dict) else "", outcome.text))
        return results


def _has_call_attempt(content: object) -> bool:
    if not isinstance(content, str):
        return False
    parsed = parse_tool_calls(content, set(TOOL_NAMES))
    return bool(parsed.calls or parsed.errors)


def replay(item: dict, turns: list) -> Episode:
    return replay_turns(Episode.start(item), turns)


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reward: float
    targets_done: int
    targets: int
    refused: int
    touched_outside: tuple[str, ...]  # ids outside the task whose status was changed


def verdict(ep: Episode) -> Verdict:
    goal = targets(ep.item)
    initial = {t["id"]: t["status"] for t in ep.item["tickets"]}
    final = ep.ledger.statuses()
    touched_outside = tuple(sorted({tid for tid, _, _ in ep.ledger.changes if tid not in goal}))
    done = sum(final[tid] == status for tid, status in goal.items())
    wrong = [tid for tid, status in goal.items()
             if final[tid] != status and (RANK[final[tid]] > RANK[status] or RANK[final[tid]] < RANK[initial[tid]])]
    refused = ep.ledger.refused
    penalty = min(MAX_PENALTY, REFUSAL_PENALTY * refused)
    if ep.end == "broken_call":
        label, value = "broken_call", -1.0
    elif ep.calls == 0:
        label, value = "no_tool_call", -1.0
    elif touched_outside:
        label, value = "collateral", -1.0
    elif wrong:
        label, value = "wrong_state", -1.0
    elif done == len(goal):
        label, value = ("solved" if refused == 0 else "solved_with_refusals"), 1.0 - penalty
    else:
        label, value = "unsolved", PARTIAL_CREDIT * done / len(goal) - penalty
    return Verdict(label, value, done, len(goal), refused, touched_outside)
