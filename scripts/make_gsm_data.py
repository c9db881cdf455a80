"""Write the math word problem environment's data files: `python scripts/make_gsm_data.py [--check]`.

Needs `reasoning-gym==0.1.25` (`pip install -e '.[gsm]'`); the environment itself (rlsys/envs/gsm) reads the
JSONL files this writes and never imports reasoning-gym.

Source: reasoning-gym's `gsm_symbolic` generators, one per GSM8K question turned into a template with typed
variables (names, objects, numbers) and the answer computed from them. Only the 85 templates reasoning-gym
itself uses (`tasks_ok`; the others are marked "need fix" upstream).

- Split by template: HELDOUT_SHARE of the templates, drawn with a fixed seed, are held out; the train file
  draws only from the rest, so a held-out question is never a training question with other numbers.
- Each item is one generator call with its own seed (`_item_seed`), so a file is a pure function of the
  constants below: `--check` regenerates both files in memory and compares them byte for byte.
- Rejected and drawn again: questions with a number of 4+ decimals (float noise such as 18.083333333333332
  in the text), answers that are not finite or have more than 2 decimals, duplicate questions.
- Held-out items also carry what the perturbations need (rlsys/envs/gsm/perturb.py): `names` (the person names
  that occur in the question) and `numbers_variant`, the same template with the same names and objects and
  new numbers, its answer computed by the template (`_numbers_variant`).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlsys.envs.gsm.dataset import DATA_DIR, HELDOUT_KEYS, ITEM_KEYS, validate_item  # noqa: E402

RG_VERSION = "0.1.25"
SEED = 0
TRAIN_COUNT, HELDOUT_COUNT = 1024, 256
HELDOUT_SHARE = 0.2
NAME_KEY = re.compile(r"^(name\d*|student_name|person\d*|sibling\d*)$")
NAME_VALUE = re.compile(r"^[A-Z][a-z]+$")
LONG_DECIMAL = re.compile(r"\d\.\d{4,}")
VARIANT_TRIES = 400


def generators() -> tuple[dict, list[int]]:
    """reasoning-gym's gsm_symbolic generators by template number, and the templates it uses (`tasks_ok`)."""
    from importlib.metadata import version

    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import GSMSymbolicDataset, GSMSymbolicDatasetConfig, tasks_ok

    # the distribution's version: the module's own __version__ says 0.1.19 in the 0.1.25 wheel
    if version("reasoning-gym") != RG_VERSION:
        raise SystemExit(f"make_gsm_data: needs reasoning-gym=={RG_VERSION}, found {version('reasoning-gym')}: "
                         "the files would differ")
    gens = GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=SEED, size=1)).generators
    return gens, sorted(tasks_ok)


def template_split(templates: list[int]) -> tuple[list[int], list[int]]:
    """(train templates, held-out templates), disjoint, fixed by SEED."""
    heldout = sorted(random.Random(f"gsm/templates/{SEED}").sample(templates, round(HELDOUT_SHARE * len(templates))))
    return [t for t in templates if t not in heldout], heldout


def _item_seed(split: str, index: int, attempt: int) -> int:
    return random.Random(f"gsm/{split}/{SEED}/{index}/{attempt}").getrandbits(32)


class _Recorder(random.Random):
    """Records the strings the generator picks (names, objects) in order."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.picked: list = []

    def choice(self, seq):
        out = super().choice(seq)
        if isinstance(out, str):
            self.picked.append(out)
        return out

    def sample(self, population, k, **kw):
        out = super().sample(population, k, **kw)
        if out and all(isinstance(x, str) for x in out):
            self.picked.append(list(out))
        return out


class _Pinned(random.Random):
    """Draws numbers from its own seed but gives back the strings another draw picked, in the same order."""

    def __init__(self, seed: int, picked: list) -> None:
        super().__init__(seed)
        self._picked = list(picked)

    def choice(self, seq):
        out = super().choice(seq)
        if isinstance(out, str) and self._picked and self._picked[0] in seq:
            return self._picked.pop(0)
        return out

    def sample(self, population, k, **kw):
        out = super().sample(population, k, **kw)
        if out and all(isinstance(x, str) for x in out) and self._picked and isinstance(self._picked[0], list):
            return self._picked.pop(0)
        return out


def _strings(example: dict) -> dict:
    return {k: v for k, v in example["metadata"]["variables"].items() if isinstance(v, str)}


def _answer(example: dict) -> int | float | None:
    value = example["metadata"]["answer_value"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if float(value).is_integer():
        return int(value)
    return float(value) if round(value, 2) == value else None


def _acceptable(example: dict) -> bool:
    return _answer(example) is not None and not LONG_DECIMAL.search(example["question"])


def _numbers_variant(gen, seed: int, original: dict) -> dict | None:
    """The same template with the original's strings and other numbers: the first of VARIANT_TRIES pinned draws
    whose string variables all equal the original's and whose question differs (None if none does)."""
    rec = _Recorder(seed)
    gen(rec, 1.0)
    for attempt in range(1, VARIANT_TRIES + 1):
        variant = gen(_Pinned(random.Random(f"gsm/variant/{seed}/{attempt}").getrandbits(32), rec.picked), 1.0)
        if (_strings(variant) == _strings(original) and variant["question"] != original["question"]
                and _acceptable(variant)):
            return {"question": variant["question"], "answer": _answer(variant)}
    return None


def make_split(split: str, count: int, templates: list[int], gens: dict) -> list[dict]:
    rng = random.Random(f"gsm/{split}/{SEED}/templates")
    items, seen = [], set()
    for index in range(count):
        template = rng.choice(templates)
        for attempt in range(1000):
            seed = _item_seed(split, index, attempt)
            example = gens[template](random.Random(seed), 1.0)
            if not _acceptable(example) or example["question"] in seen:
                continue
            item = {"id": f"gsm-{split}-{index:05d}", "split": split, "template": template, "seed": seed,
                    "question": example["question"], "answer": _answer(example)}
            if split == "heldout":
                names = sorted({v for k, v in _strings(example).items()
                                if NAME_KEY.match(k) and NAME_VALUE.match(v)
                                and re.search(rf"\b{v}\b", example["question"])})
                item["names"] = names
                item["numbers_variant"] = _numbers_variant(gens[template], seed, example)
            break
        else:
            raise SystemExit(f"make_gsm_data: template {template} gave no acceptable new question in 1000 draws")
        validate_item(item)
        seen.add(item["question"])
        items.append(item)
    return items


def render(items: list[dict], keys: tuple[str, ...]) -> str:
    return "".join(json.dumps({k: item[k] for k in keys}) + "\n" for item in items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="regenerate in memory and compare with the shipped files")
    p.add_argument("--out", type=Path, default=DATA_DIR)
    args = p.parse_args(argv)
    gens, templates = generators()
    train_t, heldout_t = template_split(templates)
    files = {"train.jsonl": render(make_split("train", TRAIN_COUNT, train_t, gens), ITEM_KEYS),
             "heldout.jsonl": render(make_split("heldout", HELDOUT_COUNT, heldout_t, gens), HELDOUT_KEYS)}
    if args.check:
        stale = [n for n, text in files.items() if (args.out / n).read_text(encoding="utf-8") != text]
        print(f"make_gsm_data: {'differ: ' + ', '.join(stale) if stale else 'the shipped files are reproduced'}")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.out / name}: {text.count(chr(10))} items, {len(text.encode()) / 1024:.0f} KiB")
    print(f"templates: {len(train_t)} train, {len(heldout_t)} held out {heldout_t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
