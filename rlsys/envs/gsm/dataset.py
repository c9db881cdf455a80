"""Math word problem items: the shipped train and held-out files, and the check every line must pass.

Item (one JSONL line; scripts/make_gsm_data.py writes both files from reasoning-gym's `gsm_symbolic` templates):
    {"id": "gsm-train-00000", "split": "train" | "heldout", "template": int (the GSM8K template's number),
     "seed": int (the generator's seed), "question": str, "answer": int | float (at most 2 decimals)}
Held-out lines add what the perturbations need (perturb.py):
     "names": [person names that occur in the question],
     "numbers_variant": {"question": str, "answer": number} | null  (same template, names and objects; new numbers)

The split is by template: no held-out question comes from a template the train file uses. Files are loaded
with `load(split)`; reading them needs no reasoning-gym.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from rlsys.envs.datasets import SPLITS, check_item_keys

ITEM_KEYS = ("id", "split", "template", "seed", "question", "answer")
HELDOUT_KEYS = (*ITEM_KEYS, "names", "numbers_variant")
DATA_DIR = Path(__file__).with_name("data")
MAX_QUESTION_CHARS = 2000


def _check_answer(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: answer must be a finite number, got {value!r}")
    if round(value, 2) != value:
        raise ValueError(f"{where}: answer {value!r} has more than 2 decimals")


def _check_question(value: object, where: str) -> None:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_QUESTION_CHARS:
        raise ValueError(f"{where}: question must be a non-empty string of at most {MAX_QUESTION_CHARS} chars")


def validate_item(item: object) -> None:
    """Raise ValueError saying what is wrong if `item` is not a math word problem item."""
    check_item_keys(item, ITEM_KEYS)
    where = f"item {item['id']!r}"
    if item["split"] not in SPLITS:
        raise ValueError(f"{where}: split must be one of {SPLITS}, got {item['split']!r}")
    if type(item["template"]) is not int or type(item["seed"]) is not int:
        raise ValueError(f"{where}: template and seed must be ints")
    _check_question(item["question"], where)
    _check_answer(item["answer"], where)
    names = item.get("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{where}: names must be a list of strings")
    variant = item.get("numbers_variant")
    if variant is not None:
        if not isinstance(variant, dict) or set(variant) != {"question", "answer"}:
            raise ValueError(f"{where}: numbers_variant must be null or {{question, answer}}")
        _check_question(variant["question"], f"{where} numbers_variant")
        _check_answer(variant["answer"], f"{where} numbers_variant")


def load(split: str, path: str | Path | None = None) -> list[dict]:
    """The shipped `split` file (or `path`), every line validated."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(path) if path is not None else DATA_DIR / f"{split}.jsonl"
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for item in items:
        validate_item(item)
    return items
