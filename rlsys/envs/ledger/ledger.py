"""The ticket ledger: an in-memory state machine built from an item, driven by tool calls.

Rules (the same for every split):
- Statuses and legal transitions: open -> in_progress -> resolved -> closed (forward), plus the
  reopens in_progress -> open and resolved -> in_progress. closed is final.
- `update_ticket(id, status)` to the status the ticket already has is a no-op that succeeds
  (idempotent: repeating a call changes nothing and is not an error). Any other status must be a
  legal next step, or the call is refused and nothing changes.
- Every call is checked before it runs: an unknown tool, arguments that are not JSON text of an
  object with exactly the documented keys (string values, a known status), an unknown ticket id:
  refused, nothing changes. Refusals are counted (`refused`).
- Reads (`list_tickets`, `read_ticket`) never change anything.

`changes` logs every applied status change (id, old, new) in order: the verdict uses it to tell
"touched" from "unchanged", so a ticket changed and changed back still counts as touched.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

from rlsys.envs.ledger.prompt import STATUSES, TOOL_NAMES, Presentation, dumps

TRANSITIONS = {"open": ("in_progress",), "in_progress": ("resolved", "open"),
               "resolved": ("closed", "in_progress"), "closed": ()}
RANK = {s: i for i, s in enumerate(STATUSES)}  # position on the forward chain
_ARG_KEYS = {"list_tickets": (set(), {"status"}), "read_ticket": ({"id"}, set()),
             "update_ticket": ({"id", "status"}, set())}  # (required, optional)


@dataclass
class ToolOutcome:
    text: str  # the tool message content
    ok: bool  # False: refused (nothing changed)
    changed: bool = False  # True: a ticket's status changed


@dataclass
class Ledger:
    tickets: dict[str, dict]  # id -> canonical record
    order: list[str]  # record order as presented
    presentation: Presentation
    changes: list[tuple[str, str, str]] = field(default_factory=list)  # (id, old, new) applied, in order
    refused: int = 0

    @classmethod
    def from_item(cls, item: dict) -> "Ledger":
        tickets = copy.deepcopy(item["tickets"])
        return cls(tickets={t["id"]: t for t in tickets}, order=[t["id"] for t in tickets],
                   presentation=Presentation.of(item))

    def statuses(self) -> dict[str, str]:
        return {tid: self.tickets[tid]["status"] for tid in self.order}

    def execute(self, name: object, arguments: object) -> ToolOutcome:
        """Run one tool call (name, arguments as JSON text) against the ledger."""
        args_or_error = self._check(name, arguments)
        if isinstance(args_or_error, ToolOutcome):
            self.refused += 1
            return args_or_error
        outcome = getattr(self, f"_{name}")(**args_or_error)
        if not outcome.ok:
            self.refused += 1
        return outcome

    def _check(self, name: object, arguments: object) -> dict | ToolOutcome:
        p = self.presentation
        if name not in TOOL_NAMES:
            return ToolOutcome(p.error("bad_arguments", tool=str(name), why="no such tool"), ok=False)
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else None
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            return ToolOutcome(p.error("bad_arguments", tool=name, why="arguments must be a JSON object"), ok=False)
        required, optional = _ARG_KEYS[name]
        keys = set(args)
        if not required <= keys or not keys <= required | optional:
            expected = ", ".join(sorted(required) + [f"{k} (optional)" for k in sorted(optional)]) or "none"
            return ToolOutcome(p.error("bad_arguments", tool=name, why=f"expected {expected}"), ok=False)
        for key, value in args.items():
            if not isinstance(value, str):
                return ToolOutcome(p.error("bad_arguments", tool=name, why=f"{key} must be a string"), ok=False)
        if "status" in args and args["status"] not in STATUSES:
            return ToolOutcome(p.error("bad_arguments", tool=name, why=f"status must be one of {', '.join(STATUSES)}"),
                               ok=False)
        if "id" in args and args["id"] not in self.tickets:
            return ToolOutcome(p.error("not_found", id=args["id"]), ok=False)
        return args

    def _list_tickets(self, status: str | None = None) -> ToolOutcome:
        rows = [self.presentation.record(self.tickets[tid], ("id", "status", "title")) for tid in self.order
                if status is None or self.tickets[tid]["status"] == status]
        return ToolOutcome(dumps(rows), ok=True)

    def _read_ticket(self, id: str) -> ToolOutcome:  # noqa: A002 (the tool's parameter name)
        return ToolOutcome(dumps(self.presentation.record(self.tickets[id])), ok=True)

    def _update_ticket(self, id: str, status: str) -> ToolOutcome:  # noqa: A002
        ticket = self.tickets[id]
        old = ticket["status"]
        shown = self.presentation.fields["status"]
        if status == old:
            return ToolOutcome(dumps({"id": id, shown: old, "changed": False}), ok=True)
        if status not in TRANSITIONS[old]:
            return ToolOutcome(self.presentation.error("illegal", id=id, old=old, new=status,
                                                       allowed=", ".join(TRANSITIONS[old])), ok=False)
        ticket["status"] = status
        self.changes.append((id, old, status))
        return ToolOutcome(dumps({"id": id, shown: status, "previous": old, "changed": True}), ok=True, changed=True)
