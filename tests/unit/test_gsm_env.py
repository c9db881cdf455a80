"""The math word problem environment (rlsys/envs/gsm): data files, the template split, the episode rules and the
outcome/reward table, the summary, and the held-out perturbations."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.envs.gsm import reward as gsm_reward
from rlsys.envs.gsm.dataset import DATA_DIR, HELDOUT_KEYS, ITEM_KEYS, load, validate_item
from rlsys.envs.gsm.episode import MAX_TURNS, answer_value, replay
from rlsys.envs.gsm.perturb import (
    PERTURBATIONS,
    REPLACEMENT_NAMES,
    effective_item,
    perturb,
    perturbed_items,
    sentences,
)

REPO = Path(__file__).resolve().parents[2]
ITEM = {"id": "q", "split": "train", "template": 0, "seed": 1, "question": "Ann has 3 bags of 4 apples. How many?",
        "answer": 12}


# ---- data ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train():
    return load("train")


@pytest.fixture(scope="module")
def heldout():
    return load("heldout")


def test_shipped_files_load_validate_and_keep_their_keys(train, heldout):
    assert (len(train), len(heldout)) == (1024, 256)
    assert all(tuple(i) == ITEM_KEYS and i["split"] == "train" for i in train)
    assert all(tuple(i) == HELDOUT_KEYS and i["split"] == "heldout" for i in heldout)
    assert len({i["id"] for i in train + heldout}) == len(train) + len(heldout)
    assert len({i["question"] for i in train}) == len(train) and len({i["question"] for i in heldout}) == len(heldout)
    for path in DATA_DIR.glob("*.jsonl"):
        assert path.stat().st_size < 400_000, f"{path.name} is larger than the few hundred KB the repo ships"


def test_held_out_templates_are_disjoint_from_the_train_templates(train, heldout):
    train_t, heldout_t = {i["template"] for i in train}, {i["template"] for i in heldout}
    assert train_t.isdisjoint(heldout_t)
    assert len(train_t) >= 60 and len(heldout_t) >= 15
    assert not {i["question"] for i in train} & {i["question"] for i in heldout}


@pytest.mark.parametrize("change, message", [
    ({"answer": "12"}, "finite number"), ({"answer": True}, "finite number"), ({"answer": 1.234}, "2 decimals"),
    ({"answer": float("nan")}, "finite number"), ({"question": ""}, "question"), ({"split": "test"}, "split"),
    ({"template": "0"}, "template and seed"), ({"names": "Ann"}, "names"),
    ({"numbers_variant": {"question": "x?"}}, "numbers_variant"),
    ({"numbers_variant": {"question": "x?", "answer": None}}, "numbers_variant: answer"),
])
def test_validate_item_says_what_is_wrong(change, message):
    validate_item(ITEM)
    with pytest.raises(ValueError, match=message):
        validate_item({**ITEM, **change})
    with pytest.raises(ValueError, match="missing key"):
        validate_item({k: v for k, v in ITEM.items() if k != "answer"})


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                    reason="reasoning-gym is not installed (pip install -e '.[gsm]')")
def test_the_data_script_reproduces_the_shipped_files():
    done = subprocess.run([sys.executable, str(REPO / "scripts/make_gsm_data.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- episodes and the reward table -----------------------------------------------------------------


def call(name: str, args: object, call_id: str = "c") -> dict:
    return {"id": call_id, "name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}


def turn(*calls: dict, content: str | None = None, errors: list | None = None) -> dict:
    return {"content": content, "tool_calls": list(calls), "finish_reason": "tool_calls" if calls else "stop",
            "tool_call_errors": errors or [], "completion_ids": [1, 2]}


def judged(*turns: dict, item: dict = ITEM) -> tuple[str, float]:
    record = {"item": item, "output": {"turns": list(turns)}}
    return gsm_reward.outcome(record), gsm_reward.reward(record)


CALC = turn(call("calculate", {"expression": "3 * 4"}))
BAD_CALC = turn(call("calculate", {"expression": "3 apples * 4"}))


@pytest.mark.parametrize("turns, expected", [
    ([turn(call("answer", {"value": 12}))], ("right", 1.0)),
    ([CALC, turn(call("answer", {"value": 12.0}))], ("right", 1.0)),
    ([CALC, turn(call("answer", {"value": "12"}))], ("right", 1.0)),
    ([turn(call("answer", {"value": 12.0000000001}))], ("right", 1.0)),
    ([CALC, BAD_CALC, turn(call("answer", {"value": 12}))], ("right", 1.0)),
    ([turn(call("calculate", {"expression": "3*4"}), call("answer", {"value": 12}))], ("right", 1.0)),
    ([turn(call("answer", {"value": 13}))], ("wrong", 0.0)),
    ([turn(call("answer", {"value": 12.01}))], ("wrong", 0.0)),
    ([turn(content="The answer is 12.")], ("no_answer", -1.0)),
    ([CALC, turn(content="12")], ("no_answer", -1.0)),
    ([turn(content="3 bags of 4 is 12."), turn(call("answer", {"value": 12}))], ("right", 1.0)),  # after the nudge
    ([turn(content="12"), turn(content="twelve")], ("no_answer", -1.0)),
    ([], ("no_answer", -1.0)),
    ([CALC], ("no_answer", -1.0)),  # turns that stop early (e.g. the context filled up)
    ([turn(call("answer", {"value": "twelve"}))], ("malformed_call", -1.0)),
    ([turn(call("answer", {"value": "12 apples"}))], ("malformed_call", -1.0)),
    ([turn(call("answer", {"value": True}))], ("malformed_call", -1.0)),
    ([turn(call("answer", {"answer": 12}))], ("malformed_call", -1.0)),
    ([turn(call("answer", "{not json"))], ("malformed_call", -1.0)),
    ([turn(call("calculate", {"expr": "1+1"}))], ("malformed_call", -1.0)),
    ([turn(call("calculate", {"expression": 12}))], ("malformed_call", -1.0)),
    ([turn(call("search", {"query": "x"}))], ("malformed_call", -1.0)),
    ([turn(errors=[{"kind": "invalid_json", "message": "..."}], content="<tool_call>{")], ("malformed_call", -1.0)),
    ([turn(content='{"name": "answer", "arguments": {"value": 12')], ("malformed_call", -1.0)),
    ([BAD_CALC, turn(content="I cannot compute that.")], ("calculator_error", -1.0)),
    ([BAD_CALC] * MAX_TURNS, ("calculator_error", -1.0)),
    ([CALC] * MAX_TURNS, ("too_many_turns", -1.0)),
])
def test_outcome_and_reward_table(turns, expected):
    assert judged(*turns) == expected
    assert expected[0] in gsm_reward.OUTCOMES and gsm_reward.REWARD_BY_OUTCOME[expected[0]] == expected[1]


def test_every_outcome_has_a_reward_in_minus_one_zero_one():
    assert set(gsm_reward.REWARD_BY_OUTCOME) == set(gsm_reward.OUTCOMES)
    assert set(gsm_reward.REWARD_BY_OUTCOME.values()) == {-1.0, 0.0, 1.0}


def test_the_episode_gives_calculator_results_and_errors_back_as_tool_results():
    ep = replay(ITEM, [])
    assert ep.play_turn(turn(call("calculate", {"expression": "3 * 4"}, "a"), call("calculate", {"expression": "1/0"},
                                                                                        "b"))) == \
        [("a", "12"), ("b", "error: division by zero")]
    assert [c["ok"] for c in ep.calculations] == [True, False] and not ep.over
    assert ep.play_turn(turn(call("answer", {"value": 12}), call("calculate", {"expression": "1"}))) is None
    assert ep.label == "right" and len(ep.calculations) == 2, "calls after answer are ignored"
    with pytest.raises(ValueError, match="agent bug"):
        ep.play_turn(CALC)


def test_the_turn_cap_ends_the_episode_after_max_turns():
    ep = replay(ITEM, [CALC] * (MAX_TURNS - 1))
    assert not ep.over
    assert ep.play_turn(CALC) is None and ep.end == "too_many_turns"


def test_the_reward_replays_the_turns_and_ignores_what_the_agent_claims():
    record = {"item": ITEM, "output": {"turns": [turn(content="12")], "answer": 12.0, "end": "answered"}}
    assert gsm_reward.reward(record) == -1.0
    assert gsm_reward.reward({"item": ITEM, "output": "12"}) == -1.0
    with pytest.raises(ValueError, match="missing key"):
        gsm_reward.reward({"item": {"id": "x"}, "output": {"turns": []}})
    with pytest.raises(ValueError, match="not a turn record"):
        gsm_reward.reward({"item": ITEM, "output": {"turns": ["12"]}})


@pytest.mark.parametrize("value, number", [(12, 12.0), (-2.5, -2.5), ("1,250", 1250.0), (" 3.5 ", 3.5),
                                           ("1,25", None), ("$12", None), ("1e3", None), (float("inf"), None),
                                           (None, None), (False, None)])
def test_answer_values(value, number):
    assert answer_value(value) == number


def test_summarize_gives_accuracy_and_with_records_the_calculator_use():
    outcomes = ["right", "wrong", "no_answer", "failed"]
    assert gsm_reward.summarize(outcomes) == {"right_rate": 0.25, "answered_rate": 0.5, "malformed_call_rate": 0.0}
    records = [{"item": ITEM, "output": {"turns": t}} for t in
               ([CALC, BAD_CALC, turn(call("answer", {"value": 12}))], [turn(call("answer", {"value": 1}))],
                [turn(content="hi")], [])]
    out = gsm_reward.summarize(outcomes, records)
    assert out["calculator_use_rate"] == 0.25 and out["calculator_calls_mean"] == 0.5
    assert out["calculator_error_rate"] == 0.5
    assert [gsm_reward.episode_metrics(r) for r in records[:2]] == [
        {"calculator_calls": 2.0, "calculator_errors": 1.0, "used_calculator": 1.0, "right_with_calculator": 1.0},
        {"calculator_calls": 0.0, "calculator_errors": 0.0, "used_calculator": 0.0, "right_with_calculator": 0.0}]
    wrong_with = {"item": ITEM, "output": {"turns": [CALC, turn(call("answer", {"value": 13}))]}}
    assert gsm_reward.episode_metrics(wrong_with)["right_with_calculator"] == 0.0


# ---- perturbations ---------------------------------------------------------------------------------


def test_every_perturbation_applies_to_most_held_out_items_and_stays_a_valid_item(heldout):
    for kind in PERTURBATIONS:
        items = perturbed_items(heldout, kind)
        assert len(items) >= 0.6 * len(heldout), kind
        for p in items:
            validate_item(p)
            assert p["id"].endswith(f"+{kind}") and p["perturbation"] == kind and p["question"] != \
                next(i for i in heldout if i["id"] == p["id"].split("+")[0])["question"]


def test_numbers_keep_names_and_wording_and_carry_the_templates_answer(heldout):
    for item in heldout:
        p = perturb(item, "numbers")
        assert p["answer"] == item["numbers_variant"]["answer"] and p["question"] == item["numbers_variant"]["question"]
        strip = lambda q: re.sub(r"\d+(\.\d+)?", "#", q)  # noqa: E731
        assert strip(p["question"]) == strip(item["question"]) or len(p["question"].split()) == \
            len(item["question"].split()), "the numbers variant changed more than numbers"
        assert all(re.search(rf"\b{n}\b", p["question"]) for n in item["names"])


def test_names_replaces_every_person_name_and_nothing_else(heldout):
    for item in [i for i in heldout if i["names"]]:
        p = perturb(item, "names")
        assert p["answer"] == item["answer"] and len(p["names"]) == len(item["names"])
        assert not any(re.search(rf"\b{n}\b", p["question"]) for n in item["names"])
        assert set(p["names"]) <= set(REPLACEMENT_NAMES) and len(set(p["names"])) == len(p["names"])
        assert re.sub(r"\b[A-Z][a-z]+\b", "N", p["question"]) == re.sub(r"\b[A-Z][a-z]+\b", "N", item["question"])
    assert perturb({**ITEM, "names": []}, "names") is None


def test_replacement_names_never_occur_in_the_data(train, heldout):
    for item in train + heldout:
        for name in REPLACEMENT_NAMES:
            assert not re.search(rf"\b{name}\b", item["question"]), (name, item["id"])


def test_question_first_moves_the_question_sentence_to_the_front():
    item = {**ITEM, "question": "Mr. Lee has 3 bags. Each holds 4 apples. How many apples does Mr. Lee have?"}
    assert sentences(item["question"]) == ["Mr. Lee has 3 bags.", "Each holds 4 apples.",
                                           "How many apples does Mr. Lee have?"]
    p = perturb(item, "question_first")
    assert p["question"] == "How many apples does Mr. Lee have? Mr. Lee has 3 bags. Each holds 4 apples."
    assert p["answer"] == 12
    assert perturb({**ITEM, "question": "What is 3 times 4?"}, "question_first") is None
    assert perturb({**ITEM, "question": "Ann has 3. Find the total."}, "question_first") is None


def test_question_first_keeps_every_sentence(heldout):
    for item in heldout:
        p = perturb(item, "question_first")
        if p is not None:
            assert sorted(sentences(p["question"])) == sorted(sentences(item["question"]))


def test_perturbations_are_pure_and_unknown_kinds_are_refused(heldout):
    assert [perturb(i, "names") for i in heldout] == [perturb(i, "names") for i in heldout]
    with pytest.raises(ValueError, match="unknown perturbation"):
        perturb(ITEM, "shuffled")


def test_the_agent_and_the_reward_see_the_prompt_variant_the_framework_sets(heldout):
    item = heldout[0]
    assert effective_item(item) is item and effective_item({**item, "prompt_variant": "default"})["id"] == item["id"]
    numbers = effective_item({**item, "prompt_variant": "numbers"})
    assert numbers["answer"] == item["numbers_variant"]["answer"]
    record = {"item": {**item, "prompt_variant": "numbers"},
              "output": {"turns": [turn(call("answer", {"value": numbers["answer"]}))]}}
    assert gsm_reward.outcome(record) == "right"
    with pytest.raises(ValueError, match="not a math word problem perturbation"):
        effective_item({**item, "prompt_variant": "grid_alt"})  # tic-tac-toe's: refused, not silently ignored
