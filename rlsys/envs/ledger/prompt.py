"""What the model sees of the ledger: system prompt, task text, tool schemas, records and error messages.

Why a presentation layer separate from the state machine (ledger.py): the held-out split changes how
the same world is shown (renamed fields, reordered records, different error messages) while the rules
and the verdict stay the same, so eval measures robustness to wording, not a different task.

Presentation (item["presentation"]):
    {"fields": {canonical name: shown name}, "errors": "plain" | "coded"}
Record order is the order of item["tickets"] (train: sorted by id; held-out: shuffled).
Tool names, parameter names and status values never change: they are the API.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

STATUSES = ("open", "in_progress", "resolved", "closed")
FIELDS = ("id", "title", "status", "assignee", "priority", "tag")
PLAIN_FIELDS = {f: f for f in FIELDS}
RENAMED_FIELDS = {"id": "id", "title": "summary", "status": "state", "assignee": "owner",
                  "priority": "severity", "tag": "label"}
ERROR_STYLES = ("plain", "coded")

SYSTEM_PROMPT = (
    "You are a support-desk agent. You work on a ticket ledger only through the tools. "
    "Statuses follow the workflow open -> in_progress -> resolved -> closed; in_progress -> open and "
    "resolved -> in_progress reopen a ticket, and closed is final. One update_ticket call moves a ticket one step. "
    "Change only the tickets the task asks for and leave every other ticket as it is. "
    "When the task is done, answer with a short summary and no tool call."
)

_STATUS_PARAM = {"type": "string", "enum": list(STATUSES)}
TOOLS = [
    {"type": "function", "function": {
        "name": "list_tickets",
        "description": "List tickets (id, status, title), optionally only those with one status.",
        "parameters": {"type": "object", "properties": {"status": _STATUS_PARAM}, "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_ticket",
        "description": "Read every field of one ticket.",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "update_ticket",
        "description": ("Move one ticket to the next status of the workflow. "
                        "Setting the status it already has changes nothing."),
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "status": _STATUS_PARAM},
                       "required": ["id", "status"], "additionalProperties": False}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)


@dataclass(frozen=True)
class Presentation:
    fields: dict  # canonical field name -> the name the model sees
    errors: str  # "plain" | "coded"

    @classmethod
    def of(cls, item: dict) -> "Presentation":
        p = item["presentation"]
        return cls(fields=dict(p["fields"]), errors=p["errors"])

    def record(self, ticket: dict, keys: tuple[str, ...] = FIELDS) -> dict:
        return {self.fields[k]: ticket[k] for k in keys}

    def error(self, kind: str, **facts: str) -> str:
        """An error tool result. kinds: not_found(id), illegal(id, old, new, allowed), bad_arguments(tool, why)."""
        if self.errors == "coded":
            code = {"not_found": "404 NOT_FOUND", "illegal": "409 TRANSITION_REFUSED",
                    "bad_arguments": "400 BAD_REQUEST"}[kind]
            detail = {"not_found": lambda f: f["id"], "illegal": lambda f: f"{f['id']} {f['old']}->{f['new']}",
                      "bad_arguments": lambda f: f"{f['tool']}: {f['why']}"}[kind](facts)
            return f"ERR {code} {detail}"
        if kind == "not_found":
            return f"error: there is no ticket {facts['id']}"
        if kind == "illegal":
            return (f"error: {facts['id']} cannot go from {facts['old']} to {facts['new']} "
                    f"(allowed next: {facts['allowed'] or 'none, it is closed'})")
        return f"error: bad arguments for {facts['tool']}: {facts['why']}"


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def instruction(item: dict) -> str:
    """The task as the user asks it, with the presentation's field names."""
    task, shown = item["task"], item["presentation"]["fields"]
    if task["kind"] == "single":
        return f"Move ticket {task['ticket']} to {task['target']}."
    return (f"Every ticket whose {shown['status']} is {task['status']} and whose {shown[task['field']]} is "
            f"{task['value']} must end up {task['target']}. Do not change any other ticket.")


def first_messages(item: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction(item)}]
