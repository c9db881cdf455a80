"""Training items: read from JSONL (every bad line named by file:line) and served in seeded epochs.

`ItemStream` is the data cursor that checkpoints save: the same seed and cursor give the same batches
after a resume, whatever happened to the process in between. Its optional curriculum (`data.signal_replay`)
serves part of each batch from a queue of items whose last group still had a learning signal (queued by the
rollout phase, saved with the cursor), so the items the policy has not settled yet come back sooner.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
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
    """Batches of items in a seeded order, reshuffled each epoch; `state_dict` is the resumable cursor.

    With ``replay_frac`` > 0, ``int(replay_frac * batch_size)`` items of a batch come first from the replay queue
    (`replay`: items whose last group had signal, oldest first, at most one entry per item), the rest from the
    epoch order, whose cursor only they advance."""

    items: list[dict[str, Any]]
    seed: int = 0
    shuffle: bool = True
    replay_frac: float = 0.0
    epoch: int = 0
    position: int = 0
    queue: list[int] = field(default_factory=list)  # item indices to serve again, oldest first
    replayed: int = 0  # items served from the queue by this process (a count for metrics, not saved)
    # share of recent groups with signal (rlsys.sampling.next_signal_rate): how many boards dynamic sampling draws
    # first; saved with the cursor so that a resumed run draws as the uninterrupted one would
    signal_rate: float = 1.0
    _index: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # id(item) -> its index

    def __post_init__(self) -> None:
        self._index = {id(item): i for i, item in enumerate(self.items)}

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[dict[str, Any]]:
        replayed = min(int(self.replay_frac * batch_size), len(self.queue))
        batch = [self.items[i] for i in self.queue[:replayed]]
        del self.queue[:replayed]
        self.replayed += replayed
        order = self._order(self.epoch)
        while len(batch) < batch_size:
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            batch.append(self.items[order[self.position]])
            self.position += 1
        return batch

    def replay(self, items: list[dict[str, Any]]) -> None:
        """Queue these items (objects this stream served) to be served again; no-op unless ``replay_frac`` > 0."""
        if self.replay_frac <= 0:
            return
        for item in items:
            i = self._index[id(item)]
            if i not in self.queue:
                self.queue.append(i)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "num_items": len(self.items),
                "replay_queue": list(self.queue), "signal_rate": self.signal_rate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_items") != len(self.items):
            raise DatasetError(
                f"data cursor was saved for {state.get('num_items')} items, the dataset has {len(self.items)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.queue = [int(i) for i in state.get("replay_queue", [])]  # absent in checkpoints before the queue
        self.signal_rate = float(state.get("signal_rate", 1.0))  # likewise before dynamic sampling's rate
