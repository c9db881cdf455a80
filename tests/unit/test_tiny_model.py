"""Tests for rlsys.models.tiny: the tiny Qwen2 model, its tokenizer, chat template and cache.

One folder is built per test module (a few seconds); the cache and CLI tests build their own.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsys.models import tiny
from rlsys.proxy.toolcalls import parse_tool_calls

TOOL = {
    "type": "function",
    "function": {
        "name": "choose_square",
        "description": "Place your X on a free square of the board.",
        "parameters": {
            "type": "object",
            "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["square"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [
    {"role": "system", "content": "You play tic-tac-toe as X. Call choose_square with a free square."},
    {"role": "user", "content": "X|O|3\nX|5|O\n7|8|9\nYour move."},
]
CALL_TEXT = '<tool_call>\n{"name": "choose_square", "arguments": {"square": 7}}\n</tool_call>'


def _assistant_call(arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "choose_square", "arguments": arguments}}
        ],
    }


def _file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny.build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _prompt_text(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=[TOOL], add_generation_prompt=add_generation_prompt, tokenize=False
    )


def test_folder_loads_and_gives_the_in_memory_models_logits(model_dir, tokenizer):
    model, memory_tokenizer = tiny.create_tiny_model(seed=0)
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    assert loaded.config.model_type == "qwen2" and loaded.dtype == torch.float32
    assert loaded.config.tie_word_embeddings
    text = _prompt_text(tokenizer, MESSAGES, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == memory_tokenizer.encode(text, add_special_tokens=False)
    input_ids = torch.tensor([ids])  # (1, T)
    with torch.no_grad():
        expected = model.eval()(input_ids).logits  # (1, T, V)
        actual = loaded.eval()(input_ids).logits  # (1, T, V)
    assert actual.shape == (1, len(ids), len(tokenizer))
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def test_size_is_a_few_million_parameters_at_most(model_dir):
    n_params = tiny.count_parameters(model_dir)
    assert 500_000 < n_params < 5_000_000, n_params


def test_same_seed_same_files_other_seed_other_weights(model_dir, tmp_path):
    again = tiny.build_tiny_model(tmp_path / "again", seed=0)
    assert _file_hashes(again) == _file_hashes(model_dir)
    model_1, _ = tiny.create_tiny_model(seed=1)
    model_0, _ = tiny.create_tiny_model(seed=0)
    weight = "model.embed_tokens.weight"
    assert not torch.equal(model_0.state_dict()[weight], model_1.state_dict()[weight])


def test_autotokenizer_ids_equal_the_raw_tokenizers_ids(model_dir, tokenizer):
    # transformers 5 loads a qwen2 folder with Qwen2Tokenizer, which rebuilds the pre-tokenizer from
    # scratch; a tokenizer-only folder loads as PreTrainedTokenizerFast. Both must match tokenizer.json.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer_only = model_dir.parent / "tokenizer_only"
    tokenizer_only.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tokenizer_only / name).write_bytes((model_dir / name).read_bytes())
    plain = AutoTokenizer.from_pretrained(tokenizer_only)
    texts = tiny.generate_corpus(n_chats=30, n_english=30, n_json=30) + [
        " X | 2 | O\n---+---+---\n 4 | X | 6\n---+---+---\n 7 | 8 | O",
        "Ünïcödé café e\u0301 日本語 12345 3.14 \t\n  ",
        "<tool_call><|im_start|>x<|im_end|></tool_call><tool_response><|endoftext|></tool_response>",
    ]
    for text in texts:
        expected = raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
        assert tokenizer(text)["input_ids"] == expected, f"special tokens added to {text!r}"
        assert plain.encode(text, add_special_tokens=False) == expected, text


def test_digits_are_single_tokens_split_individually(tokenizer):
    digit_ids = []
    for digit in "0123456789":
        ids = tokenizer.encode(digit, add_special_tokens=False)
        assert len(ids) == 1, (digit, ids)
        digit_ids.append(ids[0])
    assert tokenizer.encode("12345", add_special_tokens=False) == [digit_ids[int(d)] for d in "12345"]
    for square in range(1, 10):
        ids = tokenizer.encode(f'{{"square": {square}}}', add_special_tokens=False)
        assert digit_ids[square] in ids, square
    board = tokenizer.encode("X|2|O\n4|X|6\n7|8|9", add_special_tokens=False)
    assert [i for i in board if i in digit_ids] == [digit_ids[d] for d in (2, 4, 6, 7, 8, 9)]


def test_special_tokens_have_single_ids_and_eos_is_im_end(model_dir, tokenizer):
    for token in tiny.SPECIAL_TOKENS + tiny.TOOL_TAGS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == pad
    assert tokenizer.bos_token is None
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["vocab_size"]) == (im_end, pad, len(tokenizer))
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == [im_end, pad]
    # Tool tags are not 'special': decoding with skip_special_tokens keeps them, drops <|im_end|>.
    ids = tokenizer.encode(CALL_TEXT + "<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == CALL_TEXT


def test_chat_template_renders_tools_and_a_call_the_parser_reads_back(tokenizer):
    prompt = _prompt_text(tokenizer, MESSAGES, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n" + MESSAGES[0]["content"] + "\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in prompt
    assert prompt.endswith("Your move.<|im_end|>\n<|im_start|>assistant\n")
    full = _prompt_text(tokenizer, [*MESSAGES, _assistant_call({"square": 7})], add_generation_prompt=False)
    assert full.startswith(prompt)
    assistant_text = full[len(prompt):]
    assert assistant_text == CALL_TEXT + "<|im_end|>\n"
    # The proxy parses the decoded completion (special tokens skipped).
    completion_ids = tokenizer.encode(assistant_text, add_special_tokens=False)
    parsed = parse_tool_calls(tokenizer.decode(completion_ids, skip_special_tokens=True), {"choose_square"})
    assert parsed.errors == [] and parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.calls] == [("choose_square", {"square": 7})]
    # OpenAI clients send arguments as JSON text: rendered verbatim, not JSON-encoded twice.
    openai_style = _prompt_text(tokenizer, [*MESSAGES, _assistant_call('{"square": 7}')], add_generation_prompt=False)
    assert openai_style == full
    # Without tools the template still renders (plain system turn).
    plain = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert plain.startswith("<|im_start|>system\n" + MESSAGES[0]["content"] + "<|im_end|>\n")


def test_tokenized_chat_template_matches_encoding_the_text(tokenizer):
    text = _prompt_text(tokenizer, MESSAGES, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(MESSAGES, tools=[TOOL], add_generation_prompt=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == ["<|im_start|>"]  # no BOS


def test_next_turn_extends_prompt_plus_sampled_tokens(tokenizer):
    """Multi-turn prefix property: re-rendering after a tool result starts with exactly the earlier prompt
    ids + the sampled assistant ids (ending in <|im_end|>). The one gap: the template's "\\n" after
    <|im_end|> is not sampled; it is the first token of the next (masked) segment."""
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, tools=[TOOL], add_generation_prompt=True, return_dict=False)
    sampled_ids = tokenizer.encode(CALL_TEXT + "<|im_end|>", add_special_tokens=False)
    tool_result = {"role": "tool", "content": '{"ok": true, "board": "X|O|3\\nX|5|O\\nX|8|9"}'}
    next_ids = tokenizer.apply_chat_template(
        [*MESSAGES, _assistant_call({"square": 7}), tool_result], tools=[TOOL],
        add_generation_prompt=True, return_dict=False,
    )
    prefix = prompt_ids + sampled_ids
    assert next_ids[: len(prefix)] == prefix
    gap = tokenizer.decode(next_ids[len(prefix):])
    assert gap.startswith("\n<|im_start|>user\n<tool_response>\n" + tool_result["content"] + "\n</tool_response>")
    assert gap.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_ensure_tiny_model_builds_once_then_returns_the_cache(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path / "cache"))
    first = tiny.ensure_tiny_model()
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert _file_hashes(first) == _file_hashes(model_dir)
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left
    started = time.perf_counter()
    assert tiny.ensure_tiny_model() == first
    assert time.perf_counter() - started < 0.5
    assert tiny.ensure_tiny_model(tmp_path / "cache") == first
    assert tiny.cache_key(seed=1) != tiny.cache_key(seed=0) != tiny.cache_key(seed=0, num_layers=2)


def test_ensure_tiny_model_loses_a_race_gracefully(tmp_path, monkeypatch):
    """Another process renames its copy into place while this one builds: keep theirs, drop ours."""
    final = tmp_path / "models" / f"tiny-{tiny.cache_key(seed=0)}"

    def build_while_another_process_finishes(out_dir, *, seed, **sizes):
        final.mkdir(parents=True)
        (final / "config.json").write_text("{}")
        (Path(out_dir) / "config.json").write_text('{"mine": true}')
        return Path(out_dir)

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_process_finishes)
    assert tiny.ensure_tiny_model(tmp_path) == final
    assert (final / "config.json").read_text() == "{}"
    assert sorted(os.listdir(final.parent)) == [final.name]


def test_unknown_size_argument_is_an_error():
    with pytest.raises(TypeError, match="hidden_sise"):
        tiny.resolve_sizes(hidden_sise=64)


def test_cli_builds_a_folder_with_custom_sizes(tmp_path, capsys):
    out = tmp_path / "cli"
    tiny.main(["--out", str(out), "--seed", "3", "--num-layers", "2", "--hidden-size", "64"])
    printed = capsys.readouterr().out.split()
    assert printed[0] == str(out) and int(printed[1]) == tiny.count_parameters(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 64)


def test_board_cells_tokenizer_draws_every_board_cell_as_one_token(tmp_path):
    from rlsys.envs.tictactoe.dataset import all_boards
    from rlsys.envs.tictactoe.prompt import render_board, render_board_alt

    cells = AutoTokenizer.from_pretrained(tiny.build_tiny_model(tmp_path / "cells", **tiny.NAMED_SIZES["tiny-cells"]))
    default = AutoTokenizer.from_pretrained(tiny.build_tiny_model(tmp_path / "h16", **tiny.NAMED_SIZES["tiny-h16"]))
    boards = all_boards()
    for render in (render_board, render_board_alt):  # the job's drawing and the 'grid_alt' perturbation's
        lengths = {len(cells(render(b), add_special_tokens=False)["input_ids"]) for b in boards}
        assert len(lengths) == 1, (render.__name__, lengths)
    # the default's BPE joins a separator with a mark ("|X"), so its boards vary in length
    assert len({len(default(render_board(b))["input_ids"]) for b in boards}) > 1
    # same vocabulary and ids: only merges went, so text without a separator before a mark encodes as before
    assert cells.get_vocab() == default.get_vocab()
    text = 'Squares are numbered 1-9, left to right.\n1|2|3\n{"name": "choose_square", "arguments": {"square": 7}}'
    assert cells(text)["input_ids"] == default(text)["input_ids"]
    assert cells(" X|O")["input_ids"] != default(" X|O")["input_ids"]


def test_board_cells_keeps_every_earlier_models_cache_key():
    assert tiny.cache_key(0, **tiny.NAMED_SIZES["tiny-h16"]) == tiny.cache_key(0, num_heads=16, num_kv_heads=8)
    assert tiny.cache_key(0) != tiny.cache_key(0, board_cells=True)
    assert "board_cells" not in json.dumps(tiny.resolve_sizes()) or tiny.resolve_sizes()["board_cells"] is False
