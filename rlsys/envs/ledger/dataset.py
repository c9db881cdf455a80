"""Seeded ledger worlds and tasks, with a held-out split whose presentation is perturbed.

Item (one JSONL line):
    {"id": "ledger-train-00000", "split": "train" | "heldout", "max_turns": int,
     "tickets": [{"id": "T-123", "title": str, "status": str, "assignee": str, "priority": str, "tag": str}, ...],
     "task": {"kind": "single", "ticket": id, "target": status}
           | {"kind": "filter", "status": status, "field": "assignee" | "priority" | "tag", "value": str, "target": status},
     "presentation": {"fields": {canonical: shown}, "errors": "plain" | "coded"}}

- 5 to 8 tickets; the task's targets (episode.targets) are 1 to 3 tickets whose target status is 1 or 2
  forward steps from where they start, so a solution needs 1 to 6 legal updates. Filter tasks always
  leave at least one distractor: a ticket matching the field but not the status, or the reverse.
- train: fields shown as named, records sorted by id, plain error messages.
- heldout (same rules, other worlds): fields renamed (status -> state, assignee -> owner, priority ->
  severity, tag -> label, title -> summary), records shuffled, coded error messages ("ERR 409 ...").
The same (count, seed, split) gives the same bytes. Shipped files (configs point at them):
    python -m rlsys.envs.ledger.dataset --count 256 --seed 0 --split train --out rlsys/envs/ledger/data/train.jsonl
    python -m rlsys.envs.ledger.dataset --count 64 --seed 0 --split heldout --out rlsys/envs/ledger/data/heldout.jsonl
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from rlsys.envs.datasets import check_item_keys, jsonl_lines, seeded_items, write_main
from rlsys.envs.ledger.episode import targets
from rlsys.envs.ledger.ledger import RANK
from rlsys.envs.ledger.prompt import ERROR_STYLES, FIELDS, PLAIN_FIELDS, RENAMED_FIELDS, STATUSES

ITEM_KEYS = ("id", "split", "max_turns", "tickets", "task", "presentation")
DATA_DIR = Path(__file__).with_name("data")
MAX_TURNS = 8
TITLES = {
    "billing": ("Refund not received", "Charged twice", "Invoice missing", "Wrong VAT on invoice"),
    "login": ("Password reset fails", "2FA code never arrives", "Account locked"),
    "shipping": ("Package delayed", "Wrong delivery address", "Parcel damaged"),
    "api": ("Webhook timeouts", "Rate limit too low", "API key rejected"),
}
ASSIGNEES = ("ana", "ben", "chen", "dana", "eli")
PRIORITIES = ("low", "medium", "high")
FILTER_FIELDS = ("assignee", "priority", "tag")
STATUS_WEIGHTS = (4, 3, 2, 1)  # open, in_progress, resolved, closed


def _tickets(rng: random.Random) -> list[dict]:
    ids = rng.sample(range(100, 1000), rng.randint(5, 8))
    out = []
    for n in ids:
        tag = rng.choice(sorted(TITLES))
        out.append({"id": f"T-{n}", "title": rng.choice(TITLES[tag]),
                    "status": rng.choices(STATUSES, STATUS_WEIGHTS)[0], "assignee": rng.choice(ASSIGNEES),
                    "priority": rng.choice(PRIORITIES), "tag": tag})
    return out


def _target(rng: random.Random, status: str) -> str | None:
    ahead = [s for s in STATUSES if 1 <= RANK[s] - RANK[status] <= 2]
    return rng.choice(ahead) if ahead else None


def _task(rng: random.Random, tickets: list[dict]) -> dict | None:
    if rng.random() < 0.4:
        movable = [t for t in tickets if t["status"] != "closed"]
        t = rng.choice(movable) if movable else None
        return t and {"kind": "single", "ticket": t["id"], "target": _target(rng, t["status"])}
    pivot = rng.choice([t for t in tickets if t["status"] != "closed"] or tickets)
    field_name = rng.choice(FILTER_FIELDS)
    status, value = pivot["status"], pivot[field_name]
    matches = [t for t in tickets if t["status"] == status and t[field_name] == value]
    distractors = [t for t in tickets if (t["status"] == status) != (t[field_name] == value)]
    target = _target(rng, status)
    if target is None or not 1 <= len(matches) <= 3 or not distractors:
        return None
    return {"kind": "filter", "status": status, "field": field_name, "value": value, "target": target}


def make_item(index: int, rng: random.Random, split: str) -> dict:
    while True:  # rejection sampling: a handful of draws at most
        tickets = _tickets(rng)
        task = _task(rng, tickets)
        if task is not None:
            break
    if split == "train":
        tickets.sort(key=lambda t: int(t["id"][2:]))
        presentation = {"fields": dict(PLAIN_FIELDS), "errors": "plain"}
    else:
        rng.shuffle(tickets)
        presentation = {"fields": dict(RENAMED_FIELDS), "errors": "coded"}
    return {"id": f"ledger-{split}-{index:05d}", "split": split, "max_turns": MAX_TURNS, "tickets": tickets,
            "task": task, "presentation": presentation}


def make_dataset(count: int, seed: int, split: str = "train") -> list[dict]:
    return seeded_items(make_item, "ledger", count, seed, split)


def fingerprint(item: dict) -> str:
    """The world and task, independent of presentation and record order (to check splits are disjoint)."""
    return json.dumps([sorted((sorted(t.items()) for t in item["tickets"])), sorted(item["task"].items())])


def validate_item(item: object) -> None:
    """Raise ValueError saying what is wrong if `item` is not a ledger item."""
    check_item_keys(item, ITEM_KEYS)
    where = f"item {item['id']!r}"
    if type(item["max_turns"]) is not int or item["max_turns"] < 1:
        raise ValueError(f"{where}: max_turns must be a positive int")
    ids = [t.get("id") for t in item["tickets"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: duplicate ticket ids")
    for t in item["tickets"]:
        if set(t) != set(FIELDS) or t["status"] not in STATUSES:
            raise ValueError(f"{where}: ticket {t.get('id')!r} must have exactly {FIELDS} and a known status")
    p = item["presentation"]
    if set(p.get("fields", {})) != set(FIELDS) or p.get("errors") not in ERROR_STYLES:
        raise ValueError(f"{where}: presentation needs fields for {FIELDS} and errors in {ERROR_STYLES}")
    task = item["task"]
    if task.get("kind") not in ("single", "filter") or task.get("target") not in STATUSES:
        raise ValueError(f"{where}: task must be single or filter with a known target status")
    if task["kind"] == "single" and task.get("ticket") not in ids:
        raise ValueError(f"{where}: task ticket {task.get('ticket')!r} is not in the ledger")
    if task["kind"] == "filter" and task.get("field") not in FILTER_FIELDS:
        raise ValueError(f"{where}: filter field must be one of {FILTER_FIELDS}")
    goal = targets(item)
    initial = {t["id"]: t["status"] for t in item["tickets"]}
    if not goal or any(RANK[s] <= RANK[initial[tid]] for tid, s in goal.items()):
        raise ValueError(f"{where}: the task must select tickets whose target is ahead of their status")


def to_jsonl(items: list[dict]) -> str:
    return jsonl_lines(items, ITEM_KEYS)


def main(argv: list[str] | None = None) -> int:
    return write_main(argv, "python -m rlsys.envs.ledger.dataset", "Write ledger items as JSONL.", make_dataset,
                      ITEM_KEYS, "ledger items")


if __name__ == "__main__":
    raise SystemExit(main())
