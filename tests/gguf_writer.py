"""Write a Hugging Face Qwen2 folder (the tiny model) as a GGUF file, the way llama.cpp's converter does.

Test-only: CI cannot download a real 0.5 GB GGUF, so tests/unit/test_gguf.py makes its own from the tiny model
and runs it through rlsys/models/gguf.py. What follows llama.cpp's convert_hf_to_gguf.py for "qwen2":
- metadata: general.architecture "qwen2" and the qwen2.* hyper-parameters; a byte-level BPE vocabulary
  (tokenizer.ggml.model "gpt2", pre "qwen2": the tiny tokenizer splits text with Qwen2's regex, which is what
  transformers' GGUF reader installs for "qwen2"), tokens in id order, token types (added tokens that are special
  or look like `<|...|>` are CONTROL, the other added tokens USER_DEFINED, the rest NORMAL), merges as
  "a b" strings, bos/eos/pad ids from config.json, add_bos_token false, and the chat template;
- tensors under llama.cpp's names (gguf.TensorNameMap, as the converter uses), 2-D weights as Q8_0 blocks
  (rows of 32 values, one fp16 scale each), norms and biases as F32; `output.weight` only if untied, unless
  `write_output` asks for it (Qwen2.5 GGUFs carry one even when the HF model ties it).

Departure: llama.cpp stores hyper-parameters it reads from config.json; so does this, from the folder's
config.json, and nothing else (no general.name/basename bookkeeping beyond a name).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QUANTIZED_BLOCK = 32  # Q8_0 quantizes rows in blocks of 32 values


def _looks_special(token: str) -> bool:
    """llama.cpp's `does_token_look_special`, the part that applies to Qwen-style tokens."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def _vocab(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens in id order, their GGUF token types, merges as "a b") from tokenizer.json."""
    import gguf

    data = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            special = added[i]["special"] or _looks_special(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # llama.cpp pads a vocabulary shorter than the embedding matrix this way
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, [int(t) for t in types], merges


def _tensor_data(array: np.ndarray):
    """(data, raw_dtype) for GGUFWriter.add_tensor: Q8_0 blocks for 2-D weights whose rows fit, else F32."""
    import gguf

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 2 and array.shape[-1] % QUANTIZED_BLOCK == 0:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array, None


def write_qwen2_gguf(model_dir: str | Path, out_path: str | Path, *, write_output: bool = False,
                     tokenizer_model: str = "gpt2") -> Path:
    """Write the Qwen2 HF folder `model_dir` as the GGUF file `out_path`; returns `out_path`.

    `tokenizer_model` other than "gpt2" writes a file whose tokenizer readers must refuse (for error tests).
    """
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"{model_dir}: model_type {config.get('model_type')!r}, this writer handles qwen2 only")
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    state = {name: t.astype(np.float32) for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    if write_output and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # what a tied model's head is

    writer = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    # hyper-parameters (Qwen2Model.set_gguf_parameters)
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # tokenizer (_set_vocab_gpt2 + SpecialVocab)
    tokens, types, merges = _vocab(model_dir, config["vocab_size"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = config["eos_token_id"]
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    # tensors, under llama.cpp's names
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    for hf_name in sorted(state):
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{model_dir}: no GGUF name for tensor {hf_name}")
        data, raw_dtype = _tensor_data(state[hf_name])
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
