"""The math word problem agent through the real proxy (real HTTP, the tiny model's tokenizer and chat template)
with a scripted engine instead of a model, no Ray: calculate results and errors go back as tool messages, the
session stays one token sequence, and the loss mask is 1 exactly on the sampled tokens, so it is 0 over every
tool-result token."""
from __future__ import annotations

import json

import pytest

from rlsys.envs.gsm.agent import agent_with_prompt_ids
from rlsys.envs.gsm.episode import MAX_TURNS, NUDGE
from rlsys.envs.gsm.prompt import SYSTEM_PROMPT
from rlsys.envs.gsm.reward import outcome, reward
from tests.loop.test_multiturn import IM_END, check_recorded, run_session

pytestmark = pytest.mark.timeout(120)

ITEM = {"id": "q", "split": "heldout", "template": 0, "seed": 1, "answer": 12, "names": ["Ann"],
        "question": "Ann has 3 bags with 4 apples in each bag. How many apples does Ann have?",
        "numbers_variant": {"question": "Ann has 5 bags with 4 apples in each bag. How many apples does Ann have?",
                            "answer": 20}}


def call(name: str, **args) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def masked(tokenizer, seg, value: int) -> str:
    return tokenizer.decode([t for t, m in zip(seg.input_ids, seg.loss_mask) if m == value])


def test_a_solved_problem_is_one_segment_and_tool_results_are_out_of_the_loss(tokenizer):
    script = [(call("calculate", expression="3 * 4"), IM_END), (call("calculate", expression="12 / (3 - 3)"), IM_END),
              (call("answer", value=12), IM_END)]
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, ITEM)
    assert output["end"] == "answered" and output["answer"] == 12.0
    assert [(c["result"], c["ok"]) for c in output["calculations"]] == [("12", True), ("error: division by zero", False)]
    record = {"item": ITEM, "output": output}
    assert (outcome(record), reward(record)) == ("right", 1.0)
    assert rec.num_turns == 3 and rec.segment_breaks == 0
    check_recorded(rec.segments, rec.segment_breaks, output["turns"])
    (seg,) = rec.segments
    assert masked(tokenizer, seg, 1) == "".join(text + end for text, end in script), "loss mask is not on sampled ids"
    out_of_loss = masked(tokenizer, seg, 0)
    assert out_of_loss.count("<tool_response>") == 2
    assert "<tool_response>\n12\n</tool_response>" in out_of_loss
    assert "<tool_response>\nerror: division by zero\n</tool_response>" in out_of_loss
    assert SYSTEM_PROMPT in out_of_loss and ITEM["question"] in out_of_loss


def test_every_tool_result_token_has_loss_mask_zero(tokenizer):
    script = [(call("calculate", expression="3 * 4"), IM_END), (call("answer", value=12), IM_END)]
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, ITEM)
    (seg,) = rec.segments
    # the tokens between the first turn's sampled ids and the second turn's: the tool message and the next header
    first_end = len(output["turns"][0]["prompt_ids"]) + len(output["turns"][0]["completion_ids"])
    second_start = len(output["turns"][1]["prompt_ids"])
    between = seg.input_ids[first_end:second_start]
    assert "<tool_response>\n12\n</tool_response>" in tokenizer.decode(between)
    assert seg.loss_mask[first_end:second_start] == [0] * len(between)
    assert seg.loss_mask[second_start:] == [1] * len(output["turns"][1]["completion_ids"])


def test_the_turn_cap_ends_the_episode_and_a_text_reply_is_no_answer(tokenizer):
    script = [(call("calculate", expression="1 + 1"), IM_END)] * MAX_TURNS
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, ITEM)
    assert output["end"] == "too_many_turns" and rec.num_turns == MAX_TURNS and rec.segment_breaks == 0
    assert outcome({"item": ITEM, "output": output}) == "too_many_turns"

    # a text-only turn gets the nudge once; a second one ends the episode
    script = [("Ann has 12 apples.", IM_END), ("So 12.", IM_END)]
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, ITEM)
    assert output["end"] == "no_answer" and rec.num_turns == 2
    assert reward({"item": ITEM, "output": output}) == -1.0


def test_reasoning_in_text_then_the_nudge_then_answer(tokenizer):
    script = [("3 bags of 4 apples make 12 apples.", IM_END), (call("answer", value=12), IM_END)]
    output, rec = run_session(tokenizer, script, agent_with_prompt_ids, ITEM)
    assert output["end"] == "answered" and rec.num_turns == 2
    assert outcome({"item": ITEM, "output": output}) == "right"
    (seg,) = rec.segments
    first_end = len(output["turns"][0]["prompt_ids"]) + len(output["turns"][0]["completion_ids"])
    second_start = len(output["turns"][1]["prompt_ids"])
    between = tokenizer.decode(seg.input_ids[first_end:second_start])
    assert "<|im_start|>user\n" + NUDGE in between  # the nudge is a user message, outside the loss
    assert seg.loss_mask[first_end:second_start] == [0] * (second_start - first_end)


def test_a_perturbed_item_is_what_the_model_sees_and_what_the_reward_checks(tokenizer):
    item = {**ITEM, "prompt_variant": "numbers"}
    output, rec = run_session(tokenizer, [(call("answer", value=20), IM_END)], agent_with_prompt_ids, item)
    (seg,) = rec.segments
    assert ITEM["numbers_variant"]["question"] in masked(tokenizer, seg, 0)
    assert outcome({"item": item, "output": output}) == "right"
