"""Build rlsys's own tiny Qwen2-architecture model: a tokenizer trained here, random weights, an HF folder.

Why: unit and loop tests, and CPU training runs, need a real causal LM with a real tokenizer and a
tool-calling chat template, without downloads or license questions. This module trains a byte-level
BPE tokenizer on a deterministic generated corpus (chat-formatted tic-tac-toe turns, tool schemas,
tool calls, some generic English and JSON), builds a small `Qwen2ForCausalLM` with seeded random
weights and saves both as an ordinary Hugging Face folder that transformers (and vLLM) load with
`AutoTokenizer` / `AutoModelForCausalLM`.

Choices worth knowing:
- The tokenizer pipeline is Qwen2's, piece for piece: NFC normalizer, Qwen's pre-tokenizer regex
  (its `\\p{N}` alternative splits every digit on its own, so the `5` in `"square": 5` is always one
  token), byte-level BPE without unk. This matters because transformers 5.x loads a folder whose
  config says `model_type: qwen2` with `Qwen2Tokenizer`, which rebuilds the pipeline from vocab and
  merges and drops any other pre-tokenizer (models/README.md); with Qwen's pipeline both
  `Qwen2Tokenizer` and a plain `PreTrainedTokenizerFast` give the same ids as the raw `tokenizers` object.
- Special tokens <|endoftext|> (pad, id 0), <|im_start|>, <|im_end|> (eos) come first; the tool tags
  <tool_call>, </tool_call>, <tool_response>, </tool_response> are added tokens that are *not* special
  (as in Qwen), so `decode(..., skip_special_tokens=True)` keeps them and the tool-call parser sees them.
  No BOS is added.
- The chat template (chat_template.jinja next to this file) is Qwen2.5-Instruct's, with a neutral
  default system prompt and one departure: an OpenAI-style call whose `arguments` is already JSON text
  is rendered verbatim instead of being JSON-encoded a second time.
- Multi-turn: re-rendering [..., assistant tool call, tool result] yields the earlier prompt ids + the
  sampled ids (`<tool_call>...</tool_call><|im_end|>`) as a prefix. The one gap is the template's "\n"
  after <|im_end|>: it is never sampled and opens the next, masked, segment.
- The corpus limits how many merges BPE can learn: for vocab sizes well above the default the
  tokenizer (and the model's vocab) may come out smaller than asked; config.json has the real size.
- Everything is deterministic: the corpus and trainer settings are fixed (the corpus does not depend
  on the weight seed), and files carry no timestamps, so the same seed and sizes give byte-identical
  files. `ensure_tiny_model` builds once into a cache folder keyed by a hash of the builder version
  and its arguments, atomically (build in a temporary folder, then rename).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Bump when anything that changes the built files changes (corpus, trainer, template, init).
BUILDER_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# Qwen2's pre-tokenizer regex (transformers' models/qwen2/tokenization_qwen2.py, Qwen's tokenizer.json).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 384,
    "vocab_size": 1024,  # target size incl. the 7 special/added tokens; tic-tac-toe text is fully merged by ~768
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "board_cells": False,  # one token per drawn board cell: no BPE merge of a separator with X or O (see below)
}

# Built-in variants, `model.ckpt = "rlsys:<name>"` (rlsys/models/resolve.py): overrides of DEFAULT_SIZES.
# tiny-h16 has the default's shape and parameter count (~920k) cut into 16 heads of width 8 (kv 8): on the
# format-SFT-then-GSPO tic-tac-toe recipe it learns where the free squares are several times more often
# than the default's 4 heads of width 32 (docs/results-cpu.md has the measurements).
# tiny-cells is tiny-h16 whose tokenizer draws every board cell as one token (`board_cells`), so each square sits
# at the same token distance from the answer's square digit on every board.
NAMED_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "tiny-h16": {"num_heads": 16, "num_kv_heads": 8},
    "tiny-cells": {"num_heads": 16, "num_kv_heads": 8, "board_cells": True},
}

_CORPUS_SEED = 20240611  # fixed: the tokenizer does not depend on the weight seed


# --------------------------------------------------------------------------------------------------
# Corpus: chat-formatted tic-tac-toe turns, tool schemas and calls, generic English, JSON
# --------------------------------------------------------------------------------------------------

_TOOL_NAMES = ("choose_square", "choose_square", "choose_square", "pick_square", "place_mark", "make_move")
_TOOL_DESCRIPTIONS = (
    "Place your X on a free square of the board.",
    "Choose the square for your next move.",
    "Mark a free square with X.",
)
_SQUARE_DESCRIPTIONS = (
    "Square number 1-9, row by row from the top left.",
    "The number of a free square, 1 to 9.",
)
_SYSTEM_SENTENCES = (
    "You play tic-tac-toe as X.",
    "You are playing tic-tac-toe as X against an opponent who plays O.",
    "This is a game of noughts and crosses and your mark is X.",
    "Squares are numbered 1-9, left to right, top to bottom.",
    "The squares are numbered 1 to 9 from the top left, row by row.",
    "Free squares show their number; taken squares show X or O.",
    "Call {tool} with the number of a free square.",
    "Pick your move by invoking {tool}; pass the square's number.",
    "Use the move tool to place your X on a free square.",
    "Win if you can, otherwise block your opponent.",
    "The square must be empty.",
    "Make exactly one tool call.",
)
_USER_LINES = (
    "Your move.",
    "It is your turn. You play X.",
    "Choose a square.",
    "What is your move?",
    "Where do you play?",
)
_ASSISTANT_PREAMBLES = (
    "I will take the center.",
    "Blocking the row.",
    "This square wins the game.",
    "Taking a corner.",
    "I play square {square}.",
)


def _random_board(rng: random.Random) -> str:
    """A random reachable-looking board as 9 chars of 'X', 'O', '.', X and O alternating from X."""
    cells = ["."] * 9
    free = list(range(9))
    rng.shuffle(free)
    for turn in range(rng.randint(0, 8)):
        cells[free[turn]] = "X" if turn % 2 == 0 else "O"
    return "".join(cells)


def _draw_board(board: str, style: int) -> str:
    """The board in one of several renderings; free squares show their number (1-9)."""
    cells = [c if c != "." else str(i + 1) for i, c in enumerate(board)]
    rows = [cells[r * 3 : r * 3 + 3] for r in range(3)]
    if style == 0:
        return "\n".join("|".join(row) for row in rows)
    if style == 1:
        return "\n---+---+---\n".join(" " + " | ".join(row) for row in rows)
    if style == 2:
        return " / ".join(" ".join(row) for row in rows)
    if style == 3:
        return "\n".join(" ".join(c if c in "XO" else "." for c in row) for row in rows)
    return board


def _tool_schema(rng: random.Random, name: str) -> dict:
    square: dict[str, Any] = {"type": "integer", "minimum": 1, "maximum": 9}
    if rng.random() < 0.6:
        square["description"] = rng.choice(_SQUARE_DESCRIPTIONS)
    function: dict[str, Any] = {"name": name}
    if rng.random() < 0.8:
        function["description"] = rng.choice(_TOOL_DESCRIPTIONS)
    function["parameters"] = {
        "type": "object",
        "properties": {"square": square},
        "required": ["square"],
        "additionalProperties": False,
    }
    return {"type": "function", "function": function}


def _tictactoe_chat(rng: random.Random) -> tuple[list[dict], list[dict] | None]:
    """One chat (messages, tools): system + board + assistant tool call(s), sometimes a tool result."""
    tool = rng.choice(_TOOL_NAMES)
    sentences = rng.sample(_SYSTEM_SENTENCES, rng.randint(2, 4))
    system = " ".join(s.format(tool=tool) for s in sentences)
    board = _random_board(rng)
    style = rng.choice((0, 0, 0, 1, 1, 2, 3, 4))
    user = f"{_draw_board(board, style)}\n{rng.choice(_USER_LINES)}"
    if style in (2, 4) or rng.random() < 0.2:
        user = f"Board: {user}" if rng.random() < 0.5 else f"Current board:\n{user}"
    messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    free = [i + 1 for i, c in enumerate(board) if c == "."] or [rng.randint(1, 9)]
    for _ in range(rng.choice((1, 1, 1, 2))):
        square = rng.choice(free) if rng.random() < 0.9 else rng.randint(1, 9)
        content = rng.choice(_ASSISTANT_PREAMBLES).format(square=square) if rng.random() < 0.15 else ""
        if rng.random() < 0.05:  # a plain-text answer without a tool call
            messages.append({"role": "assistant", "content": f"I choose square {square}."})
            break
        call = {"type": "function", "function": {"name": tool, "arguments": {"square": square}}}
        messages.append({"role": "assistant", "content": content, "tool_calls": [call]})
        result = {"ok": square in free, "square": square, "board": _draw_board(board, rng.choice((0, 4)))}
        messages.append({"role": "tool", "content": json.dumps(result)})
    tools = [_tool_schema(rng, tool)] if rng.random() < 0.95 else None
    return messages, tools


_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but what all "
    "were when we there can your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our used me man too any "
    "day same right look think also around another came come work three word must because does part "
    "even place well such here take why help put different away again off went old number great tell "
    "men say small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those always "
    "show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animal life enough took four head above kind began almost "
    "live page got earth need far hand high year mother light country father let night picture being "
    "study second soon story since white ever paper hard near sentence better best across during today "
    "however sure knew try told young sun thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five himself usually money seen car morning game "
    "board square move player opponent win lose draw center corner row column diagonal turn function "
    "tool call result error value model token server request response message user assistant system "
    "data file list string integer object array true false null python code test train step loss reward"
).split()

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today?",
    "Please answer the question in one short sentence.",
    "The server returned an error, so the request was retried after two seconds.",
    "Tic-tac-toe is a game for two players, X and O, who take turns marking the spaces in a 3x3 grid.",
    "The player who succeeds in placing three of their marks in a row, column or diagonal wins.",
    "If both players play well, the game always ends in a draw.",
    "Training a language model with reinforcement learning needs rollouts, rewards and a learner.",
    "Write a function that returns the sum of two integers.",
    "It's a sunny day; we'll go for a walk, and they've said they'd join us.",
    "Numbers such as 3.14, 42, 1,000 and 2024-06-11 should tokenize digit by digit.",
    "Thank you! Let me know if you have any other questions.",
)


def _english_line(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(_SENTENCES)
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!", ":", ","))


def _json_value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth < 2 and kind < 0.25:
        return {rng.choice(_WORDS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}
    if depth < 2 and kind < 0.35:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind < 0.55:
        return rng.randint(-100, 1000)
    if kind < 0.65:
        return round(rng.uniform(-10, 10), rng.randint(1, 3))
    if kind < 0.75:
        return rng.choice((True, False, None))
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _json_line(rng: random.Random) -> str:
    obj = {rng.choice(_WORDS): _json_value(rng, 1) for _ in range(rng.randint(1, 5))}
    return json.dumps(obj, indent=rng.choice((None, None, 2)))


def _compile_template(source: str):
    """Compile the chat template the way transformers does (sandbox, trim/lstrip blocks, plain tojson)."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


def generate_corpus(n_chats: int = 3000, n_english: int = 3000, n_json: int = 1000) -> list[str]:
    """The tokenizer's training texts, in a fixed order (same output on every call)."""
    rng = random.Random(_CORPUS_SEED)
    template = _compile_template(CHAT_TEMPLATE_PATH.read_text())
    texts = []
    for _ in range(n_chats):
        messages, tools = _tictactoe_chat(rng)
        texts.append(template.render(messages=messages, tools=tools, add_generation_prompt=False))
    texts += [_english_line(rng) for _ in range(n_english)]
    texts += [_json_line(rng) for _ in range(n_json)]
    return texts


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

_TAG_SPLIT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TAGS))


def _training_pieces(texts: list[str]) -> Iterator[str]:
    """Texts cut at the special/added tokens, so BPE spends no merges on their spelling."""
    for text in texts:
        for piece in _TAG_SPLIT.split(text):
            if piece:
                yield piece


def train_tokenizer(vocab_size: int = DEFAULT_SIZES["vocab_size"], board_cells: bool = False):
    """A `tokenizers.Tokenizer` with Qwen2's pipeline, trained on `generate_corpus()`; len <= vocab_size.

    `board_cells`: drop the merges of one separator character with a mark ("|X", " O"), so that a drawn board
    ("X|2|O") is one token per cell and per separator whatever the marks: each square then sits at a fixed token
    distance from the end of the prompt. The merged tokens stay in the vocabulary (never produced), so the ids and
    the vocabulary size are the default's. The pre-tokenizer stays Qwen's (transformers rebuilds it anyway).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    n_fixed = len(SPECIAL_TOKENS) + len(TOOL_TAGS)
    if vocab_size < 256 + n_fixed:
        raise ValueError(f"vocab_size must be >= {256 + n_fixed} (bytes + special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TAGS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_pieces(generate_corpus()), trainer=trainer)
    if board_cells:
        tokenizer = _without_mark_merges(tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    return tokenizer


# Byte-level BPE spells ASCII punctuation as itself and a space, newline and tab as these three characters.
_SEPARATORS = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" "\u0120\u010a\u0109")


def _without_mark_merges(tokenizer):
    """`tokenizer` minus every merge that joins one non-alphanumeric character with X or O, and every merge that
    builds on a token only those merges made."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    merges, kept, unreachable = data["model"]["merges"], [], set()
    for left, right in merges:
        if left in unreachable or right in unreachable or (left in _SEPARATORS and right in ("X", "O")):
            unreachable.add(left + right)
        else:
            kept.append([left, right])
    data["model"]["merges"] = kept
    return Tokenizer.from_str(json.dumps(data))


def _hf_tokenizer(raw_tokenizer, max_length: int):
    """Wrap the raw tokenizer for transformers: eos <|im_end|>, pad <|endoftext|>, no bos, chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE_PATH.read_text(),
    )


# --------------------------------------------------------------------------------------------------
# Model and folder
# --------------------------------------------------------------------------------------------------

def resolve_sizes(**sizes: Any) -> dict[str, Any]:
    """DEFAULT_SIZES updated with `sizes`; unknown names are an error (a typo must not build the default)."""
    unknown = set(sizes) - set(DEFAULT_SIZES)
    if unknown:
        raise TypeError(f"unknown tiny-model size argument(s) {sorted(unknown)}; known: {sorted(DEFAULT_SIZES)}")
    resolved = {**DEFAULT_SIZES, **sizes}
    resolved["rope_theta"] = float(resolved["rope_theta"])
    if resolved["hidden_size"] % resolved["num_heads"] or resolved["num_heads"] % resolved["num_kv_heads"]:
        raise ValueError(f"hidden_size must divide by num_heads and num_heads by num_kv_heads: {resolved}")
    return resolved


def create_tiny_model(*, seed: int = 0, **sizes: Any):
    """(model, tokenizer) in memory: a float32 `Qwen2ForCausalLM` with weights from `torch.manual_seed(seed)`
    and its `PreTrainedTokenizerFast` (chat template set). `sizes` override DEFAULT_SIZES."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = resolve_sizes(**sizes)
    tokenizer = _hf_tokenizer(train_tokenizer(spec["vocab_size"], spec["board_cells"]), spec["max_position_embeddings"])
    pad_id, im_end_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=pad_id,  # as in Qwen: bos names <|endoftext|>, but no BOS is ever added
        eos_token_id=im_end_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    # Generation stops at <|im_end|> (end of turn) and at <|endoftext|>, as Qwen2.5-Instruct's does.
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[im_end_id, pad_id], pad_token_id=pad_id
    )
    return model, tokenizer


def build_tiny_model(out_dir: str | os.PathLike, *, seed: int = 0, **sizes: Any) -> Path:
    """Build the tiny model (`create_tiny_model`) and save it as an HF folder at `out_dir`; returns the path.

    `sizes` override DEFAULT_SIZES (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
    vocab_size, max_position_embeddings, rope_theta). Same seed and sizes -> byte-identical files.
    `out_dir` may exist but must then be empty.
    """
    spec = resolve_sizes(**sizes)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = create_tiny_model(seed=seed, **spec)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes only `rope_parameters`; a 4.x reader would silently use its default
    # rope_theta (models/README.md, "Pitfalls"), so write the flat key too.
    _update_json(out / "config.json", rope_theta=spec["rope_theta"])
    # 5.x names its own class, which 4.x cannot load; PreTrainedTokenizerFast loads in both.
    _update_json(out / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    return out


def _update_json(path: Path, **fields: Any) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Number of distinct parameters stored in the folder's model.safetensors (tied weights once)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def cache_key(seed: int = 0, **sizes: Any) -> str:
    """Short hash of the builder version and the resolved arguments: the cache folder's suffix."""
    spec = resolve_sizes(**sizes)
    if not spec["board_cells"]:  # the key of every model built before the option existed stays the same
        del spec["board_cells"]
    payload = json.dumps({"builder": BUILDER_VERSION, "seed": seed, **spec}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    return Path(os.environ.get("RLSYS_CACHE") or Path.home() / ".cache" / "rlsys")


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None, seed: int = 0, **sizes: Any) -> Path:
    """The cached tiny model folder <cache>/models/tiny-<key>, built on first use; returns its path.

    `cache_dir` defaults to ${RLSYS_CACHE:-~/.cache/rlsys}. The build goes to a temporary sibling
    folder that is renamed into place, so a reader never sees a half-written folder; when two
    processes race, the first rename wins and the loser discards its copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / "models" / f"tiny-{cache_key(seed, **sizes)}"
    if final.is_dir():
        return final
    return publish_folder(final, lambda staging: build_tiny_model(staging, seed=seed, **sizes))


def publish_folder(final: Path, build: Callable[[Path], Any]) -> Path:
    """A cache folder written atomically: ``build(staging)`` fills a temporary sibling of ``final``, which is then
    renamed into place, so a reader never sees a half-written folder; when two processes race, the first rename
    wins and the loser discards its copy (the tiny model, GGUF conversions, merged LoRA checkpoints)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the cache folder should look like any other
        os.rename(staging, final)
    except OSError as exc:
        # rename() onto an existing non-empty folder fails: another process finished first.
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not final.is_dir():
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlsys.models.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (created; must be empty if it exists)")
    parser.add_argument("--seed", type=int, default=0)
    for name, default in DEFAULT_SIZES.items():
        if isinstance(default, bool):
            parser.add_argument(f"--{name.replace('_', '-')}", action="store_true")
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    sizes = {name: getattr(args, name) for name in DEFAULT_SIZES}
    out = build_tiny_model(args.out, seed=args.seed, **sizes)
    print(f"{out} {count_parameters(out)} parameters")


if __name__ == "__main__":
    main()
