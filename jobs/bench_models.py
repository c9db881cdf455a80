"""The models the benchmarks run (`python -m jobs.bench model`): the tiny one, or random weights in real Qwen2.5 shapes.

The random models have Qwen2.5-0.5B's, -1.5B's, -7B's or -14B's shapes and rlsys's tiny tokenizer: the weights are
random, the sizes are real.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

QWEN05B_SIZES = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                 "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                 "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
QWEN15B_SIZES = {**QWEN05B_SIZES, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                 "intermediate_size": 8960}
# Qwen2.5-7B's and -14B's shapes (untied embeddings): the LoRA memory goals of issue 27 (24 / 48 GiB budgets)
QWEN7B_SIZES = {**QWEN05B_SIZES, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN14B_SIZES = {**QWEN7B_SIZES, "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                 "num_key_value_heads": 8, "intermediate_size": 13824}
RANDOM_MODELS = {"qwen0.5b-random": QWEN05B_SIZES, "qwen1.5b-random": QWEN15B_SIZES, "qwen7b-random": QWEN7B_SIZES,
                 "qwen14b-random": QWEN14B_SIZES}
GPU_TINY_SIZES = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}  # head_dim 64 (tests/gpu/conftest.py)
GIB = 1 << 30


def model_folder(name: str, cache: Path) -> Path:
    """An HF folder for ``name``: the GPU tiny model, or a random Qwen2.5-shaped model (built once)."""
    from rlsys.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(cache / "tiny", **GPU_TINY_SIZES)
    if name == "tiny":
        return tiny
    if name not in RANDOM_MODELS:
        raise SystemExit(f"unknown --model {name!r}; expected tiny or one of {sorted(RANDOM_MODELS)}")
    out = cache / name
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(**RANDOM_MODELS[name], bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                         use_sliding_window=False, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # transformers 5 writes only `rope_parameters`; older readers would use rope_theta=10000 (models/README.md)
    cfg_file = tmp / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "rope_theta": 1000000.0}, indent=2))
    tmp.rename(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def model_ckpt(name: str | None, cache: Path) -> str | None:
    """`--model` of step/proxy: a named bench model or any `model.ckpt` value, passed through. A named model is
    built in a child process (`python -m jobs.bench model`): building it here would leave this driver holding a
    CUDA context (~0.5 GiB) that the job's memory measurements would count."""
    if name is None or not (name == "tiny" or name in RANDOM_MODELS):
        return name
    import subprocess

    out = subprocess.run([sys.executable, "-m", "jobs.bench", "model", "--model", name, "--cache", str(cache)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"building --model {name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]
