"""Tests for rlsys.models.gguf: `model.ckpt = "x.gguf"` becomes a cached HF folder that behaves like its source.

CI cannot download a real GGUF, so tests/gguf_writer.py writes the tiny model as one, the way llama.cpp's
converter writes a qwen2 model (2-D weights as Q8_0 blocks, norms and biases F32), and `resolve_model` turns it
back into a folder. The tests compare that folder with the tiny model: weights (exactly the Q8_0 round trip),
logits on a tic-tac-toe chat, tokenizer ids, config and special tokens; then the cache and the refusals.
Two full conversions (tied and untied head), a few seconds each; about 25 s in all on 2 CPU cores.
The tiny tokenizer uses Qwen2's pipeline (NFC, Qwen2's split regex, byte-level BPE), which a GGUF describes
exactly with tokenizer.ggml.pre = "qwen2", so the tokenizer tests compare arbitrary text, not a safe subset.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for  # noqa: E402
from rlsys.errors import UserInputError  # noqa: E402
from rlsys.models import gguf as rlsys_gguf  # noqa: E402
from rlsys.models.resolve import resolve_model  # noqa: E402
from rlsys.models.tiny import SPECIAL_TOKENS, TOOL_TAGS  # noqa: E402
from tests.gguf_writer import write_qwen2_gguf  # noqa: E402

# Measured on the tiny model (logit std ~0.23): Q8_0 + bf16 storage move logits by at most ~0.017 and flip
# the argmax at ~1% of positions (the random model's top-2 margin is often < 0.01). 3x headroom on both.
MAX_LOGIT_DIFF = 0.05
MIN_GREEDY_AGREEMENT = 0.95


def _chat(board: str = "X.O.X....") -> list[dict]:
    """A tic-tac-toe prompt and the tool-call answer, so the chat covers the tool tags."""
    call = {"type": "function", "function": {"name": "choose_square", "arguments": {"square": 9}}}
    return [*messages_for(board), {"role": "assistant", "content": "", "tool_calls": [call]}]


def _resolve(gguf_path: Path, cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLSYS_CACHE", str(cache))
        return Path(resolve_model(str(gguf_path)))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlsys-cache")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tiny_model_path) -> Path:
    return write_qwen2_gguf(tiny_model_path, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file, cache_root) -> Path:
    return _resolve(gguf_file, cache_root)


@pytest.fixture(scope="module")
def tokenizers(tiny_model_path, converted):
    """(original, converted) tokenizers."""
    return AutoTokenizer.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(converted)


def _logits(model_dir, ids: list[int]) -> torch.Tensor:  # (T, V)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """What a Q8_0 GGUF holds for `weight`, dequantized (by gguf-py, not by transformers)."""
    array = weight.float().numpy()
    blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))


# --------------------------------------------------------------------------------------------------
# The converted folder
# --------------------------------------------------------------------------------------------------

def test_folder_holds_a_plain_hf_model(converted, cache_root, gguf_file):
    assert converted.parent == cache_root / "models" and converted.name.startswith("gguf-tiny-q8_0-")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", ".rlsys-gguf"):
        assert (converted / name).is_file(), f"{name} missing from {sorted(p.name for p in converted.iterdir())}"
    assert json.loads((converted / ".rlsys-gguf").read_text())["source"] == str(gguf_file.resolve())
    assert not list(cache_root.glob("models/*.tmp-*")), "a staging folder was left behind"


def test_config_matches_original_with_rope_theta_at_top_level(converted, tiny_model_path):
    config = json.loads((converted / "config.json").read_text())
    original = json.loads((Path(tiny_model_path) / "config.json").read_text())
    assert config["rope_theta"] == original["rope_theta"] == 10000.0, "4.x readers need rope_theta at the top"
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"]
    assert "quantization_config" not in config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == original[key], f"config.json {key}: {config[key]!r} != original {original[key]!r}"
    assert config["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"])  # GGUF stores it as float32


def test_weights_are_the_dequantized_q8_0_blocks(converted, tiny_model_path):
    """Every 2-D weight equals gguf-py's own Q8_0 round trip (stored in bf16); norms and biases are exact."""
    original = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    weights = load_file(str(converted / "model.safetensors"))
    assert set(weights) == set(original)
    for name, weight in original.items():
        got = weights[name]
        assert got.dtype == torch.bfloat16 and got.shape == weight.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
        expected = _q8_0_round_trip(weight) if weight.dim() == 2 else weight.float()
        assert torch.equal(got, expected.to(torch.bfloat16)), f"{name}: not the dequantized GGUF tensor"


def test_logits_on_a_tictactoe_chat_stay_close_to_the_original(converted, tiny_model_path, tokenizers):
    original_tok, _ = tokenizers
    ids = original_tok.apply_chat_template(_chat(), tools=[CHOOSE_SQUARE_TOOL], tokenize=True, return_dict=False)
    expected, got = _logits(tiny_model_path, ids), _logits(converted, ids)
    diff = (got - expected).abs().max().item()
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert diff < MAX_LOGIT_DIFF, f"max |logit difference| {diff:.4f} over {len(ids)} positions"
    assert agreement >= MIN_GREEDY_AGREEMENT, f"greedy next tokens agree at only {agreement:.1%} of positions"


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def test_tokenizer_encodes_the_chat_to_the_original_ids(tokenizers):
    original, converted = tokenizers
    kwargs = {"tools": [CHOOSE_SQUARE_TOOL], "tokenize": True, "return_dict": False}
    for messages in (messages_for("X.O.X...."), _chat()):
        want = original.apply_chat_template(messages, add_generation_prompt=messages[-1]["role"] == "user", **kwargs)
        got = converted.apply_chat_template(messages, add_generation_prompt=messages[-1]["role"] == "user", **kwargs)
        assert got == want, f"converted ids differ from the original's from position {_first_difference(got, want)}"
    text = original.apply_chat_template(_chat(), tools=[CHOOSE_SQUARE_TOOL], tokenize=False)
    ids = converted.encode(text, add_special_tokens=False)
    assert converted.decode(ids) == text


@pytest.mark.parametrize("token", SPECIAL_TOKENS + TOOL_TAGS)
def test_added_token_encodes_to_its_one_id(tokenizers, token):
    original, converted = tokenizers
    assert converted.encode(token, add_special_tokens=False) == [original.convert_tokens_to_ids(token)]


TEXTS = ["cafe\u0301 na\u0308ive", "3.14 and 12345", "  two  spaces\n\n\tI've 'RE", "日本語 🚀"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_splits_like_the_original(converted, tiny_model_path, text):
    """tokenizer.json as is (what 4.x and `tokenizers` readers use), NFC normalizer included."""
    original = Tokenizer.from_file(str(Path(tiny_model_path) / "tokenizer.json"))
    got = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert got.encode(text).ids == original.encode(text).ids


def test_turns_end_with_im_end_and_no_bos_is_added(converted, tokenizers):
    _, tok = tokenizers
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.encode("Your move.", add_special_tokens=True) == tok.encode("Your move.", add_special_tokens=False)
    generation = GenerationConfig.from_pretrained(converted)
    assert generation.eos_token_id == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation.pad_token_id == tok.pad_token_id


# --------------------------------------------------------------------------------------------------
# An output head in the file (Qwen2.5 GGUFs carry `output.weight`)
# --------------------------------------------------------------------------------------------------

def test_untied_output_head_loads_as_lm_head(tmp_path, tiny_model_path, converted, tokenizers):
    path = write_qwen2_gguf(tiny_model_path, tmp_path / "tiny-untied.gguf", write_output=True)
    folder = _resolve(path, tmp_path / "cache")
    assert folder.name != converted.name, "a different file must get its own folder"
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(str(folder / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    ids = tokenizers[0].apply_chat_template(_chat(), tools=[CHOOSE_SQUARE_TOOL], tokenize=True, return_dict=False)
    diff = (_logits(folder, ids) - _logits(tiny_model_path, ids)).abs().max().item()
    assert diff < MAX_LOGIT_DIFF, f"max |logit difference| {diff:.4f} with an untied head"


# --------------------------------------------------------------------------------------------------
# Cache and refusals
# --------------------------------------------------------------------------------------------------

def test_second_resolve_reuses_the_folder(converted, gguf_file, cache_root, monkeypatch):
    def no_conversion(src, out):
        raise AssertionError(f"converted {src} again")

    marker = converted / ".rlsys-gguf"
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(rlsys_gguf, "convert_gguf", no_conversion)
    assert _resolve(gguf_file, cache_root) == converted
    assert marker.stat().st_mtime_ns == before
    assert [p.name for p in (cache_root / "models").iterdir()] == [converted.name]


def test_a_conversion_parses_the_file_once(tmp_path, monkeypatch, gguf_file):
    """transformers' loader opens a new reader in each call (config, weights, config, tokenizer), and each parses the
    whole metadata (~6 s for Qwen2.5's vocabulary on 2 cores): the conversion shares one reader per file."""
    parses: list[str] = []
    parse = gguf.GGUFReader._build_fields

    def counted(self, *args, **kwargs):
        parses.append(str(self.data.filename))
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "_build_fields", counted)
    reader_class = gguf.GGUFReader
    rlsys_gguf.ensure_gguf_folder(gguf_file, cache_dir=tmp_path / "shared")
    assert parses == [str(gguf_file)]
    assert gguf.GGUFReader is reader_class, "the shared reader outlived the conversion"

    parses.clear()  # the premise: without sharing, the same conversion parses the file several times
    monkeypatch.setattr(rlsys_gguf, "one_reader_per_file", contextlib.nullcontext)
    rlsys_gguf.ensure_gguf_folder(gguf_file, cache_dir=tmp_path / "unshared")
    assert len(parses) > 1


def test_file_that_is_not_gguf_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))  # a zip (a safetensors or .pt renamed, say)
    with pytest.raises(UserInputError, match="weights.gguf.*not a GGUF file") as info:
        resolve_model(str(path))
    assert isinstance(info.value, rlsys_gguf.GGUFError)


def test_truncated_gguf_is_refused_by_name(tmp_path, monkeypatch, gguf_file):
    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path / "cache"))
    for size in (4, 4096, gguf_file.stat().st_size // 2):  # magic only, header cut, tensors cut
        path = tmp_path / f"cut-{size}.gguf"
        path.write_bytes(gguf_file.read_bytes()[:size])
        with pytest.raises(rlsys_gguf.GGUFError, match=f"cut-{size}.gguf.*is the file complete"):
            resolve_model(str(path))
    assert not any((tmp_path / "cache" / "models").iterdir()), "a failed conversion left a folder behind"


def test_unsupported_tokenizer_is_refused_by_name(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("RLSYS_CACHE", str(tmp_path / "cache"))
    path = write_qwen2_gguf(tiny_model_path, tmp_path / "bert-vocab.gguf", tokenizer_model="bert")
    with pytest.raises(rlsys_gguf.GGUFError, match="bert-vocab.gguf.*cannot build a tokenizer"):
        resolve_model(str(path))


def test_missing_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "missing.gguf"
    with pytest.raises(UserInputError, match="missing.gguf.*not found"):
        resolve_model(str(path))
    with pytest.raises(rlsys_gguf.GGUFError, match="missing.gguf.*not found"):
        rlsys_gguf.ensure_gguf_folder(path, cache_dir=tmp_path / "cache")
