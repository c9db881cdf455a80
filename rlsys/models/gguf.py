"""`model.ckpt = "some/model.gguf"`: dequantize a GGUF file once into a plain Hugging Face folder.

The learner (transformers) and vLLM both need dense weights and a tokenizer folder, so a `.gguf` is turned
into one, cached under ${RLSYS_CACHE:-~/.cache/rlsys}/models/gguf-<name>-<key>, where the key hashes the
file's size, its first and last MiB and this converter's version (a changed file gets a new folder; the
same file is converted once). The folder holds bf16 `model.safetensors`, `config.json`,
`generation_config.json`, the tokenizer and its chat template, and `.rlsys-gguf` naming the source.

What the conversion does on top of transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`):
- dense weights: transformers >= 5.2x keeps GGUF weights packed unless asked (`GgufConfig(dequantize=True)`);
  older 5.x loads them dequantized but marks the model quantized, so the weights are copied into a fresh
  model built from the config (the route measured on the GPU machine's transformers 5.17);
- `rope_theta` is written at the top of config.json beside `rope_parameters`: 4.x readers otherwise fall
  back to 10000 and produce garbage (docs/gpu.md, "What rlsys relies on");
- Qwen2 tokenizers: tokenizer.json gets Qwen2's NFC normalizer back (the GGUF reader drops it);
- Qwen2.5 tokenizers: the added tokens the GGUF converter of some versions leaves as plain vocabulary
  (`<tool_call>` would encode as four tokens and re-tokenized turns would differ from sampled ones) are
  registered at their existing ids, and turns end with `<|im_end|>` (eos) as upstream's do;
- a check before the folder is published: the tokenizer round-trips a chat with a tool call, the chat
  template exists, and every added token encodes to one id.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlsys.errors import UserInputError

log = logging.getLogger(__name__)

CONVERTER_VERSION = "2"  # 2: tokenizer.json keeps Qwen2's NFC normalizer
# Qwen2.5 tokens that some GGUF -> HF tokenizer conversions leave unregistered (ids 151646..151664).
QWEN_SPECIAL = ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                "<|video_pad|>")
QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>")  # upstream marks these special=false


class GGUFError(UserInputError):
    """A .gguf file that cannot be turned into a model folder; the message says which file and why."""


def file_key(path: Path) -> str:
    """Cheap content key: size + first and last MiB + converter version (hashing 0.5 GB each start is slow)."""
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{path.stat().st_size}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def ensure_gguf_folder(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The HF folder for `gguf_path`, converted on first use (atomic: staged, then renamed into place)."""
    from rlsys.models.tiny import default_cache_root, publish_folder

    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise GGUFError(f"model.ckpt {str(gguf_path)!r}: file not found")
    with src.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"model.ckpt {str(gguf_path)!r}: not a GGUF file (it does not start with b'GGUF')")
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / "models" / f"gguf-{src.stem[:48]}-{file_key(src)}"
    if (final / ".rlsys-gguf").is_file():
        return final

    def build(staging: Path) -> None:
        t0 = time.perf_counter()
        convert_gguf(src, staging)
        (staging / ".rlsys-gguf").write_text(json.dumps(
            {"source": str(src), "size": src.stat().st_size, "converter": CONVERTER_VERSION,
             "seconds": round(time.perf_counter() - t0, 1)}) + "\n")

    publish_folder(final, build)
    log.info("converted %s -> %s", src, final)
    return final


def _load_dense(src: Path):
    """A dense bf16 model from the GGUF, whatever the transformers version does with its blocks."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"gguf_file": src.name, "dtype": torch.bfloat16}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None and "dequantize" in inspect.signature(gguf_config).parameters:
        kwargs["quantization_config"] = gguf_config(gguf_file=src.name, dequantize=True)
    # (versions without GgufConfig(dequantize=...) load GGUF weights dequantized anyway)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), **kwargs)
    except ImportError as err:
        raise GGUFError(f"model.ckpt {str(src)!r}: reading GGUF needs the gguf and accelerate packages "
                        f"(pip install 'rlsys[gguf]'): {err}") from None
    except (ValueError, KeyError, RuntimeError, struct.error) as err:  # struct.error: a header cut short
        raise GGUFError(f"model.ckpt {str(src)!r}: transformers {transformers.__version__} cannot load this "
                        f"GGUF; is the file complete? ({type(err).__name__}: {err})") from None
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = loaded.state_dict()
    own = model.state_dict()
    bad = [k for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing, unexpected = model.load_state_dict(state, strict=False) if not bad else ([], [])
    missing = [k for k in missing if not (k.endswith("lm_head.weight") and config.tie_word_embeddings)]
    if bad or missing or unexpected:
        raise GGUFError(f"model.ckpt {str(src)!r}: the dequantized weights do not fit the config "
                        f"(shape mismatch {bad[:3]}, missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.generation_config = loaded.generation_config
    return model.to(torch.bfloat16)


def _fix_qwen_tokenizer(tok, generation_config) -> bool:
    """Register Qwen2.5's added tokens at their ids and end turns with <|im_end|>; False if not Qwen-like."""
    from transformers import AddedToken

    vocab = tok.get_vocab()
    if not all(t in vocab for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", *QWEN_PLAIN[:2])):
        return False
    expected = {t: vocab[t] for t in QWEN_SPECIAL + QWEN_PLAIN if t in vocab}
    added = set(tok.get_added_vocab())
    special = [t for t in QWEN_SPECIAL if t in vocab and t not in added]
    if special:  # add_tokens(special_tokens=True): the same in transformers 4.x and 5.x (add_special_tokens's
        # list argument was renamed from additional_ to extra_special_tokens in 5.x)
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    plain = [t for t in QWEN_PLAIN if t in vocab and t not in added]
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    moved = {t: i for t, i in expected.items() if tok.convert_tokens_to_ids(t) != i}
    if moved:
        raise GGUFError(f"registering Qwen's added tokens moved their ids: {moved}")
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    generation_config.eos_token_id = [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    generation_config.pad_token_id = vocab["<|endoftext|>"]
    return True


def _check_tokenizer(tok, src: Path) -> None:
    if not tok.chat_template:
        raise GGUFError(f"model.ckpt {str(src)!r}: the GGUF carries no chat template (tokenizer.chat_template)")
    for text, token_id in tok.get_added_vocab().items():
        if tok.encode(text, add_special_tokens=False) != [token_id]:
            raise GGUFError(f"model.ckpt {str(src)!r}: added token {text!r} does not encode to its id {token_id}")
    chat = [{"role": "user", "content": "Board:\nX|2|O\n4|X|6\n7|8|9"},
            {"role": "assistant", "content": '{"name": "choose_square", "arguments": {"square": 5}}'}]
    text = tok.apply_chat_template(chat, tokenize=False)
    if tok.decode(tok.encode(text, add_special_tokens=False)) != text:
        raise GGUFError(f"model.ckpt {str(src)!r}: the converted tokenizer does not round-trip a chat")


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Inside: every ``gguf.GGUFReader(path)`` of one file is the same reader, parsed once.

    transformers' GGUF loader opens a new reader in each of its calls (the model's config, its weights, the config
    again, the tokenizer: four for one conversion), and a reader parses the file's whole metadata in Python (for
    Qwen2.5 its ~151k-token vocabulary and merges, ~6 s a reader on the 2-core box: Qwen2.5-Coder-0.5B's Q4_K_M
    file converted in 49.6 s with four readers, 32.2 s with one, to the same bytes). Readers are read-only memory
    maps, so sharing one is safe; a reader whose parse failed (a cut file) is not kept: the next call parses again."""
    import gguf

    base = gguf.GGUFReader
    parsed: dict[tuple[str, str], Any] = {}

    class SharedReader(base):  # a subclass, so transformers' isinstance checks (if any) still hold
        def __new__(cls, path, mode="r"):
            reader = parsed.get((os.path.abspath(path), mode))
            return reader if reader is not None else super().__new__(cls)

        def __init__(self, path, mode="r"):
            key = (os.path.abspath(path), mode)
            if parsed.get(key) is not self:  # a new reader: parse (Python calls __init__ on a returned one too)
                super().__init__(path, mode)
                parsed[key] = self

    gguf.GGUFReader = SharedReader
    try:
        yield
    finally:
        gguf.GGUFReader = base


def convert_gguf(src: Path, out: Path) -> None:
    """Write the HF folder for `src` into the (existing, empty) folder `out`."""
    from transformers import AutoTokenizer

    with one_reader_per_file():
        model = _load_dense(src)
        try:
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        except (ValueError, KeyError) as err:  # e.g. a tokenizer.ggml.model transformers has no builder for
            raise GGUFError(f"model.ckpt {str(src)!r}: cannot build a tokenizer from this GGUF "
                            f"({type(err).__name__}: {err})") from None
    if type(tok).__name__.startswith("Qwen2Tokenizer") and tok.backend_tokenizer.normalizer is None:
        # transformers' GGUF reader builds a GPT-2 pipeline without Qwen2's NFC normalizer; 5.x's Qwen2Tokenizer
        # puts it back when it reloads the folder, but readers of tokenizer.json as is (4.x, `tokenizers`, Rust
        # servers) would split decomposed text ("cafe\u0301") differently from upstream Qwen and from 5.x.
        from tokenizers import normalizers

        tok.backend_tokenizer.normalizer = normalizers.NFC()
    qwen = _fix_qwen_tokenizer(tok, model.generation_config)
    _check_tokenizer(tok, src)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # for 4.x readers (and tools pinned to them)
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tok_cfg_path = out / "tokenizer_config.json"
    if tok_cfg_path.is_file():  # stale ids copied from the GGUF header disagree with the tokens above
        tok_cfg = json.loads(tok_cfg_path.read_text())
        for key in ("eos_token_id", "pad_token_id", "bos_token_id", "model_type"):
            tok_cfg.pop(key, None)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    log.info("GGUF %s: %s, qwen tokenizer fixes %s", src.name, type(model).__name__, "applied" if qwen else "n/a")
