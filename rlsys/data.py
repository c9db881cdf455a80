"""Training items: read from JSONL (every bad line named by file:line) and served in seeded epochs.

`ItemStream` is the data cursor that checkpoints save: the same seed and cursor give the same batches
after a resume, whatever happened to the process in between.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsys.errors import UserInputError


class DatasetError(UserInputError):
    """A dataset file or line that cannot be used; the message names file:line."""


def read_jsonl(path: str | Path, validate: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every non-blank line must be a JSON object; an `id` is added (`line-<n>`) where missing.

    ``validate(item)`` (e.g. the environment's `validate_item`) raises ValueError for an item it cannot
    use; the error is re-raised naming file:line."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {p}: not found")
    items, seen = [], set()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{p}:{lineno}: not JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(item, dict):
                raise DatasetError(f"{p}:{lineno}: expected a JSON object, got {type(item).__name__}")
            if validate is not None:
                try:
                    validate(item)
                except (ValueError, TypeError, KeyError) as err:
                    raise DatasetError(f"{p}:{lineno}: {err}") from None
            item.setdefault("id", f"line-{lineno}")
            if item["id"] in seen:
                raise DatasetError(f"{p}:{lineno}: duplicate id {item['id']!r}")
            seen.add(item["id"])
            items.append(item)
    if not items:
        raise DatasetError(f"dataset {p}: no items")
    return items


@dataclass
class ItemStream:
    """Batches of items in a seeded order, reshuffled each epoch; `state_dict` is the resumable cursor."""

    items: list[dict[str, Any]]
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[dict[str, Any]]:
        batch = []
        order = self._order(self.epoch)
        while len(batch) < batch_size:
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            batch.append(self.items[order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_items": len(self.items)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_items") != len(self.items):
            raise DatasetError(
                f"data cursor was saved for {state.get('num_items')} items, the dataset has {len(self.items)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
