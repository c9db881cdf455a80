"""The ledger env without a model: state machine, presentation, dataset, verdict and reward hacks, agent loop."""
from __future__ import annotations

import asyncio
import json

import pytest

from rlsys.envs.ledger import dataset
from rlsys.envs.ledger.agent import agent
from rlsys.envs.ledger.episode import Episode, targets
from rlsys.envs.ledger.ledger import RANK, TRANSITIONS, Ledger
from rlsys.envs.ledger.prompt import RENAMED_FIELDS, TOOL_NAMES, TOOLS, first_messages, instruction
from rlsys.envs.ledger.reward import OUTCOMES, judge, outcome, reward, summarize

TICKETS = [
    {"id": "T-101", "title": "Charged twice", "status": "open", "assignee": "ana", "priority": "high", "tag": "billing"},
    {"id": "T-102", "title": "Invoice missing", "status": "open", "assignee": "ben", "priority": "low", "tag": "billing"},
    {"id": "T-103", "title": "Account locked", "status": "in_progress", "assignee": "ana", "priority": "high", "tag": "login"},
    {"id": "T-104", "title": "Package delayed", "status": "resolved", "assignee": "ana", "priority": "low", "tag": "shipping"},
]
PLAIN = {"fields": {f: f for f in ("id", "title", "status", "assignee", "priority", "tag")}, "errors": "plain"}
# the task selects open tickets assigned to ana: T-101 only (T-102 is open but ben's, T-103 ana's but in progress)
ITEM = {"id": "l", "split": "train", "max_turns": 8, "tickets": TICKETS, "presentation": PLAIN,
        "task": {"kind": "filter", "status": "open", "field": "assignee", "value": "ana", "target": "resolved"}}


def call(name, call_id="c0", **args):
    return {"id": call_id, "name": name, "arguments": json.dumps(args)}


def turn(*calls, content=None, errors=()):
    return {"content": content, "tool_calls": list(calls), "finish_reason": "tool_calls" if calls else "stop",
            "tool_call_errors": list(errors)}


def record(turns, item=ITEM, **extra):
    return {"item": item, "output": {"turns": turns, **extra}}


SOLVE = [turn(call("list_tickets", status="open")), turn(call("read_ticket", id="T-101")),
         turn(call("update_ticket", id="T-101", status="in_progress")),
         turn(call("update_ticket", id="T-101", status="resolved")), turn(content="T-101 is resolved.")]


# ---- the state machine --------------------------------------------------------------------------


def test_legal_transitions_follow_the_workflow_and_closed_is_final():
    for old, allowed in TRANSITIONS.items():
        for new in RANK:
            ledger = Ledger.from_item({**ITEM, "tickets": [{**TICKETS[0], "status": old}]})
            out = ledger.execute("update_ticket", json.dumps({"id": "T-101", "status": new}))
            if new == old:
                assert out.ok and not out.changed and json.loads(out.text)["changed"] is False
            else:
                assert out.ok == (new in allowed) and out.changed == (new in allowed), (old, new)
                assert ledger.tickets["T-101"]["status"] == (new if new in allowed else old)
    assert TRANSITIONS["closed"] == ()


def test_updates_are_idempotent_and_refusals_change_nothing():
    ledger = Ledger.from_item(ITEM)
    before = ledger.statuses()
    assert not ledger.execute("update_ticket", json.dumps({"id": "T-101", "status": "resolved"})).ok  # skips a step
    assert ledger.statuses() == before and ledger.refused == 1
    first = ledger.execute("update_ticket", json.dumps({"id": "T-101", "status": "in_progress"}))
    again = ledger.execute("update_ticket", json.dumps({"id": "T-101", "status": "in_progress"}))
    assert first.changed and again.ok and not again.changed
    assert ledger.changes == [("T-101", "open", "in_progress")] and ledger.refused == 1
    assert ITEM["tickets"][0]["status"] == "open", "the item must not be mutated"


@pytest.mark.parametrize("name, arguments, why", [
    ("update_ticket", '{"id": "T-101"}', "expected id, status"),
    ("update_ticket", '{"id": "T-101", "status": "resolved", "note": "x"}', "expected id, status"),
    ("update_ticket", '{"id": "T-101", "status": "done"}', "status must be one of"),
    ("read_ticket", '{"id": 101}', "id must be a string"),
    ("read_ticket", "T-101", "must be a JSON object"),
    ("list_tickets", '{"status": "pending"}', "status must be one of"),
    ("delete_ticket", '{"id": "T-101"}', "no such tool"),
    ("read_ticket", '{"id": "T-999"}', "no ticket T-999"),
])
def test_bad_calls_are_refused_with_a_reason_and_counted(name, arguments, why):
    ledger = Ledger.from_item(ITEM)
    out = ledger.execute(name, arguments)
    assert not out.ok and not out.changed and why in out.text and ledger.refused == 1
    assert ledger.changes == []


def test_reads_list_in_record_order_and_filter_by_status():
    ledger = Ledger.from_item(ITEM)
    rows = json.loads(ledger.execute("list_tickets", "{}").text)
    assert [r["id"] for r in rows] == ["T-101", "T-102", "T-103", "T-104"] and set(rows[0]) == {"id", "status", "title"}
    assert [r["id"] for r in json.loads(ledger.execute("list_tickets", '{"status": "open"}').text)] == ["T-101", "T-102"]
    assert json.loads(ledger.execute("read_ticket", '{"id": "T-103"}').text) == TICKETS[2]
    assert ledger.changes == [] and ledger.refused == 0


def test_heldout_presentation_renames_fields_reorders_records_and_codes_errors():
    item = {**ITEM, "tickets": TICKETS[::-1], "presentation": {"fields": RENAMED_FIELDS, "errors": "coded"}}
    ledger = Ledger.from_item(item)
    rows = json.loads(ledger.execute("list_tickets", "{}").text)
    assert [r["id"] for r in rows] == ["T-104", "T-103", "T-102", "T-101"] and set(rows[0]) == {"id", "state", "summary"}
    assert set(json.loads(ledger.execute("read_ticket", '{"id": "T-101"}').text)) == {
        "id", "summary", "state", "owner", "severity", "label"}
    assert ledger.execute("update_ticket", '{"id": "T-104", "status": "open"}').text == "ERR 409 TRANSITION_REFUSED T-104 resolved->open"
    assert ledger.execute("read_ticket", '{"id": "T-9"}').text == "ERR 404 NOT_FOUND T-9"
    assert "owner is ana" in instruction(item) and "state is open" in instruction(item)


# ---- dataset ------------------------------------------------------------------------------------


def test_dataset_is_deterministic_valid_and_the_shipped_files_match_the_generator():
    assert dataset.make_dataset(30, 1) == dataset.make_dataset(30, 1) != dataset.make_dataset(30, 2)
    for split, count in (("train", 256), ("heldout", 64)):
        shipped = (dataset.DATA_DIR / f"{split}.jsonl").read_text()
        assert shipped == dataset.to_jsonl(dataset.make_dataset(count, 0, split)), f"{split}.jsonl is stale"


def test_splits_are_disjoint_and_heldout_is_perturbed():
    train, held = dataset.make_dataset(256, 0, "train"), dataset.make_dataset(64, 0, "heldout")
    assert not {dataset.fingerprint(i) for i in train} & {dataset.fingerprint(i) for i in held}
    assert all(i["presentation"]["fields"]["status"] == "status" and i["presentation"]["errors"] == "plain" for i in train)
    assert all(i["presentation"]["fields"] == RENAMED_FIELDS and i["presentation"]["errors"] == "coded" for i in held)
    assert all([t["id"] for t in i["tickets"]] == sorted((t["id"] for t in i["tickets"]), key=lambda s: int(s[2:]))
               for i in train)
    assert sum([t["id"] for t in i["tickets"]] != sorted(t["id"] for t in i["tickets"]) for i in held) > 32
    assert {i["task"]["kind"] for i in train} == {"single", "filter"}


def oracle_turns(item):
    """List, read everything, then advance every target one step per turn, then answer."""
    goal, cur = targets(item), {t["id"]: t["status"] for t in item["tickets"]}
    turns = [turn(call("list_tickets")), turn(*[call("read_ticket", f"r{i}", id=t) for i, t in enumerate(cur)])]
    while any(cur[t] != s for t, s in goal.items()):
        step = []
        for tid, status in goal.items():
            if cur[tid] != status:
                cur[tid] = next(n for n in TRANSITIONS[cur[tid]] if RANK[n] > RANK[cur[tid]])
                step.append(call("update_ticket", f"u{len(step)}", id=tid, status=cur[tid]))
        turns.append(turn(*step))
    return turns + [turn(content="Done.")]


def test_every_shipped_task_is_solvable_within_max_turns():
    for split, count in (("train", 256), ("heldout", 64)):
        for item in dataset.make_dataset(count, 0, split):
            turns = oracle_turns(item)
            assert len(turns) <= item["max_turns"]
            assert outcome(record(turns, item)) == "solved" and reward(record(turns, item)) == 1.0


@pytest.mark.parametrize("bad, match", [
    ({"task": {**ITEM["task"], "value": "nobody"}}, "must select tickets"),
    ({"task": {**ITEM["task"], "target": "open"}}, "must select tickets"),
    ({"task": {"kind": "single", "ticket": "T-999", "target": "closed"}}, "not in the ledger"),
    ({"presentation": {"fields": {}, "errors": "plain"}}, "presentation"),
    ({"tickets": TICKETS + TICKETS[:1]}, "duplicate"),
])
def test_validate_item_names_the_problem(bad, match):
    with pytest.raises(ValueError, match=match):
        dataset.validate_item({**ITEM, **bad})


# ---- verdict and reward hacks -------------------------------------------------------------------


def test_targets_come_from_the_task_and_the_initial_state():
    assert targets(ITEM) == {"T-101": "resolved"}
    assert targets({**ITEM, "task": {"kind": "single", "ticket": "T-104", "target": "closed"}}) == {"T-104": "closed"}


def test_solving_the_task_scores_one_and_refusals_cost_a_tenth_each():
    assert judge(record(SOLVE)).outcome == "solved" and reward(record(SOLVE)) == 1.0
    sloppy = [turn(call("update_ticket", id="T-101", status="resolved"), call("read_ticket", "c1", id="T-9"))] + SOLVE
    v = judge(record(sloppy))
    assert v.outcome == "solved_with_refusals" and v.refused == 2 and v.reward == pytest.approx(0.8)
    spam = [turn(call("read_ticket", id="T-9"))] * 7 + SOLVE[2:4]
    assert judge(record(spam, {**ITEM, "max_turns": 9})).reward == pytest.approx(0.5)  # penalty capped at 0.5


def test_partial_progress_scores_partial_credit():
    item = {**ITEM, "task": {"kind": "filter", "status": "open", "field": "tag", "value": "billing", "target": "in_progress"}}
    one = [turn(call("update_ticket", id="T-101", status="in_progress")), turn(content="done")]
    v = judge(record(one, item))
    assert (v.outcome, v.targets_done, v.targets, v.reward) == ("unsolved", 1, 2, pytest.approx(0.2))


def test_hack_editing_a_ticket_outside_the_task_is_collateral_even_if_undone():
    extra = SOLVE[:4] + [turn(call("update_ticket", id="T-102", status="in_progress")), turn(content="done")]
    assert outcome(record(extra)) == "collateral" and reward(record(extra)) == -1.0
    undone = SOLVE[:4] + [turn(call("update_ticket", id="T-102", status="in_progress"),
                               call("update_ticket", "c1", id="T-102", status="open")), turn(content="done")]
    v = judge(record(undone))
    assert v.outcome == "collateral" and v.touched_outside == ("T-102",)
    # an idempotent no-op update of another ticket touches nothing
    noop = SOLVE[:4] + [turn(call("update_ticket", id="T-102", status="open")), turn(content="done")]
    assert outcome(record(noop)) == "solved"


def test_hack_bulk_moving_everything_is_collateral():
    bulk = [turn(*[call("update_ticket", f"c{i}", id=t["id"], status="in_progress") for i, t in enumerate(TICKETS)]),
            turn(*[call("update_ticket", f"c{i}", id=t["id"], status="resolved") for i, t in enumerate(TICKETS)])]
    assert outcome(record(bulk)) == "collateral"


def test_hack_claiming_success_without_doing_it_scores_as_not_done():
    claim = [turn(content="All done: T-101 is resolved.")]
    assert outcome(record(claim)) == "no_tool_call" and reward(record(claim)) == -1.0
    read_then_claim = SOLVE[:2] + [turn(content="T-101 is now resolved.")]
    assert outcome(record(read_then_claim)) == "unsolved" and reward(record(read_then_claim)) == 0.0
    # the agent's own report is never read: forged final statuses and actions change nothing
    forged = record(read_then_claim, final_statuses={"T-101": "resolved"}, end="answered",
                    actions=[{"name": "update_ticket", "arguments": '{"id": "T-101", "status": "resolved"}', "ok": True}])
    assert outcome(forged) == "unsolved"


def test_hack_calling_a_tool_that_does_not_exist_is_a_broken_call():
    # the proxy does not deliver calls to unknown tools: they arrive as tool_call_errors ...
    attempt = turn(content='<tool_call>\n{"name": "set_status", "arguments": {"id": "T-101", "status": "resolved"}}\n</tool_call>',
                   errors=[{"kind": "unknown_tool", "message": "set_status"}])
    assert outcome(record([attempt])) == "broken_call"
    # ... and an agent that did not carry the errors still has the attempt in the content
    assert outcome(record([{**attempt, "tool_call_errors": []}])) == "broken_call"
    # a call that did reach the agent with an unknown name is refused by the ledger, changing nothing
    assert judge(record([turn(call("set_status", id="T-101", status="resolved")), turn(content="ok")])).refused == 1


def test_overshooting_a_target_is_wrong_state():
    past = SOLVE[:4] + [turn(call("update_ticket", id="T-101", status="closed")), turn(content="closed it")]
    assert outcome(record(past)) == "wrong_state" and reward(record(past)) == -1.0


def test_broken_output_scores_minus_one_and_turns_after_the_end_raise():
    for output in (None, {}, {"turns": None}, "x"):
        assert reward({"item": ITEM, "output": output}) == -1.0
    with pytest.raises(ValueError, match="is over"):
        reward(record([turn(content="bye"), SOLVE[0]]))
    with pytest.raises(ValueError, match="is over"):
        reward(record([SOLVE[0]] * 9))  # max_turns is 8


def test_outcomes_and_summary():
    assert set(OUTCOMES) == {"solved", "solved_with_refusals", "unsolved", "no_tool_call", "broken_call", "collateral",
                             "wrong_state"}
    assert summarize(["solved", "solved_with_refusals", "collateral", "broken_call"]) == {
        "solved_rate": 0.5, "clean_solve_rate": 0.25, "collateral_rate": 0.25, "protocol_error_rate": 0.25}


# ---- the agent loop -----------------------------------------------------------------------------


def completion(content, calls=()):
    from openai.types.chat import ChatCompletion

    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in calls]
    return ChatCompletion.model_validate({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}]})


class FakeClient:
    def __init__(self, replies):
        self.replies, self.requests = list(replies), []
        self.chat = self.completions = self

    async def create(self, **kwargs):
        self.requests.append(json.loads(json.dumps(kwargs)))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_agent_runs_calls_on_its_own_ledger_and_answers_each_with_a_tool_message():
    client = FakeClient([completion(t["content"], t["tool_calls"]) for t in SOLVE])
    out = asyncio.run(agent(ITEM, client, "m"))
    assert out["end"] == "answered" and out["final_statuses"]["T-101"] == "resolved" and len(out["turns"]) == 5
    assert reward({"item": ITEM, "output": out}) == 1.0
    last = client.requests[-1]["messages"]
    assert last[:2] == first_messages(ITEM)
    assert [m["role"] for m in last[2:]] == ["assistant", "tool"] * 4
    for asst, tool in zip(last[2::2], last[3::2]):
        assert tool["tool_call_id"] == asst["tool_calls"][0]["id"]
    assert json.loads(last[3]["content"])[0]["id"] == "T-101"  # list_tickets(status=open)
    assert [t["function"]["name"] for t in client.requests[0]["tools"]] == list(TOOL_NAMES) == [t["function"]["name"] for t in TOOLS]


def test_agent_stops_at_max_turns_and_on_a_full_context():
    import httpx
    import openai

    reads = [completion(None, [call("read_ticket", id="T-101")])] * 3
    out = asyncio.run(agent({**ITEM, "max_turns": 3}, FakeClient(reads), "m"))
    assert out["end"] == "max_turns" and len(out["turns"]) == 3

    request = httpx.Request("POST", "http://x/v1/chat/completions")
    full = openai.BadRequestError("messages: the prompt is 2040 tokens; the model's context is 2048 tokens, which "
                                  "leaves no room to generate", response=httpx.Response(400, request=request), body=None)
    out = asyncio.run(agent(ITEM, FakeClient(reads[:1] + [full]), "m"))
    assert out["end"] == "context_full" and len(out["turns"]) == 1
    assert outcome({"item": ITEM, "output": out}) == "unsolved"
    with pytest.raises(openai.BadRequestError):  # on the first request it is a real error
        asyncio.run(agent(ITEM, FakeClient([full]), "m"))


def test_sft_chats_use_legal_calls_only_and_render_as_one_prefix_extended_chat():
    from transformers import AutoTokenizer

    from rlsys.envs.ledger.sft_data import make_sft_dataset
    from rlsys.models.tiny import ensure_tiny_model
    from rlsys.sft import render_chat

    chats = make_sft_dataset(6, 0)
    assert chats == make_sft_dataset(6, 0)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    for chat, item in zip(chats, dataset.make_dataset(6, 0)):
        turns = [{"content": m["content"], "tool_calls": [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in m.get("tool_calls") or []]} for m in chat["messages"] if m["role"] == "assistant"]
        v = judge(record(turns, item))
        assert v.refused == 0 and v.outcome != "broken_call"
        render_chat(tokenizer, chat["messages"], chat["tools"])  # raises unless each turn extends the last
