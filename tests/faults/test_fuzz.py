"""Thousands of random and adversarial inputs: the tool-call parser never raises, and the proxy never
answers a client error with a 500 and keeps serving (real uvicorn, real HTTP)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlsys.proxy.toolcalls import ParseResult, parse_tool_calls
from tests.unit.test_proxy_server import GOOD, TOOLS, body, fuzz_server, model_dir, tokenizer  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(300)

pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"', "\\", '"name"', '"arguments"', ":", ",",
                          "choose_square", '{"square": 5}', "```json", "```", "\n", "null", "[", "]"])
model_like = st.lists(st.one_of(pieces, st.text(max_size=8)), max_size=60).map("".join)


@settings(max_examples=4000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(model_like, st.text(max_size=300)), names=st.one_of(st.none(), st.just({"choose_square"})))
def test_parser_never_raises_and_returns_typed_results(text, names):
    result = parse_tool_calls(text, tool_names=names)
    assert isinstance(result, ParseResult)
    for call in result.calls:
        assert isinstance(call.name, str) and isinstance(call.arguments, dict)
        if names is not None:
            assert call.name in names


@settings(max_examples=2000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(raw=body, path=st.sampled_from(["/v1/chat/completions"] * 6 + ["/v1/models", "/health", "/v1/x"]))
def test_proxy_answers_every_fuzzed_request_without_a_500(fuzz_server, raw, path):  # noqa: F811
    r = fuzz_server.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (raw, r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]


def test_proxy_still_serves_after_the_fuzz(fuzz_server):  # noqa: F811
    r = fuzz_server.post("/v1/chat/completions", json={**GOOD, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
