"""Held-out perturbations: the same problems with other numbers, other names, or the question asked first.

`perturb(item, kind)` returns a new item (id suffixed `+<kind>`, `"perturbation": kind`) that the agent and
the reward treat like any other, or None where the kind does not apply to the item:
    numbers         the item's `numbers_variant`: the same template with the same names and objects and other
                    numbers, the answer computed by the template (scripts/make_gsm_data.py); held-out items only
    names           every first name of `names` (family names such as "Mrs. Lee" are not in it) replaced, whole words only, by a name from REPLACEMENT_NAMES
                    (none of them occurs in any generator's name list, and they are gender-neutral, so "she"/"he"
                    in the question still reads right); the answer is unchanged
    question_first  the last sentence (the question) moved to the front, the premises after it in their
                    order. Premises are not shuffled: later ones refer back to earlier ones ("She then sold
                    half of them"), so a shuffle would change or break the problem. Needs a question sentence
                    ending in "?" after at least one premise.
`perturbed_items(items, kind)` is the perturbed set where the kind applies. Plain functions of the item: no
random state, the same item gives the same perturbed item.
"""
from __future__ import annotations

import hashlib
import re

PERTURBATIONS = ("numbers", "names", "question_first")
REPLACEMENT_NAMES = ("Avery", "Rowan", "Quinn", "Sasha", "Emerson", "Reese", "Skyler", "Dakota", "Marlowe", "Ellis",
                     "Kendall", "Hayden")
# a sentence ends at . ? ! followed by a space and a capital letter, except after these abbreviations
_ABBREVIATIONS = ("Mr.", "Mrs.", "Ms.", "Dr.", "Prof.", "St.", "Jr.", "Sr.")
_BOUNDARY = re.compile(r"(?<=[.?!])\s+(?=[A-Z\"'])")


def sentences(text: str) -> list[str]:
    """`text` split into sentences (whitespace between them dropped)."""
    out: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        if text[start:m.start()].endswith(_ABBREVIATIONS):
            continue
        out.append(text[start:m.start()])
        start = m.end()
    out.append(text[start:])
    return [s for s in out if s]


def _derived(item: dict, kind: str, question: str, **changes: object) -> dict:
    return {**item, "id": f"{item['id']}+{kind}", "perturbation": kind, "question": question, **changes}


def _pick_names(item: dict, count: int) -> list[str]:
    free = [n for n in REPLACEMENT_NAMES if not re.search(rf"\b{n}\b", item["question"])]
    start = int.from_bytes(hashlib.blake2b(item["id"].encode(), digest_size=4).digest(), "little") % len(free)
    return (free[start:] + free[:start])[:count]


def perturb(item: dict, kind: str) -> dict | None:
    """The perturbed item, or None where `kind` does not apply (see the module docstring)."""
    if kind not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {PERTURBATIONS}")
    question = item["question"]
    if kind == "numbers":
        variant = item.get("numbers_variant")
        return _derived(item, kind, variant["question"], answer=variant["answer"]) if variant else None
    if kind == "names":
        names = [n for n in item.get("names", []) if re.search(rf"\b{re.escape(n)}\b", question)]
        if not names or len(names) > len(REPLACEMENT_NAMES):
            return None
        mapping = dict(zip(sorted(names, key=len, reverse=True), _pick_names(item, len(names))))
        pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in mapping) + r")\b")
        return _derived(item, kind, pattern.sub(lambda m: mapping[m.group(1)], question),
                        names=[mapping[n] for n in item["names"] if n in mapping])
    parts = sentences(question)
    if len(parts) < 2 or not parts[-1].endswith("?"):
        return None
    return _derived(item, kind, " ".join([parts[-1], *parts[:-1]]))


def perturbed_items(items: list[dict], kind: str) -> list[dict]:
    """The items `kind` applies to, perturbed."""
    return [p for p in (perturb(item, kind) for item in items) if p is not None]


def effective_item(item: dict) -> dict:
    """The item an episode runs on: `item` itself, or its perturbation when the framework set
    `item["prompt_variant"]` to one of PERTURBATIONS (`rlsys eval --perturb` sets it per variant). Another
    variant name (tic-tac-toe's) raises: that evaluation would silently repeat the unperturbed problem."""
    variant = item.get("prompt_variant", "default")
    if variant == "default":
        return item
    if variant not in PERTURBATIONS:
        raise ValueError(f"item {item.get('id')!r}: prompt_variant {variant!r} is not a math word problem "
                         f"perturbation {PERTURBATIONS}")
    perturbed = perturb(item, variant)
    if perturbed is None:
        raise ValueError(f"item {item.get('id')!r}: perturbation {variant!r} does not apply to it")
    return perturbed
