"""Turn `model.ckpt` into something `from_pretrained` (and vLLM) can load.

- `rlsys:tiny` (or a named variant such as `rlsys:tiny-h16`, tiny.NAMED_SIZES): the embedded tiny model,
  built once and cached (rlsys/models/tiny.py);
- a local folder with config.json: used as is;
- a LoRA checkpoint (a folder with adapter_config.json, `learner.lora`): base + adapter merged once into a cached
  folder (rlsys/lora.py `ensure_merged_folder`), so `rlsys eval` and `rlsys play` take LoRA checkpoints too;
- a `.gguf` file: dequantized once into a cached Hugging Face folder (rlsys/models/gguf.py);
- anything else that is not a local path: a Hugging Face hub id, left to transformers (needs network).
"""
from __future__ import annotations

from pathlib import Path

from rlsys.errors import UserInputError


class ModelSpecError(UserInputError):
    """`model.ckpt` names nothing loadable; the message says what was looked for."""


def resolve_model(ckpt: str) -> str:
    if ckpt.startswith("rlsys:"):
        name = ckpt.split(":", 1)[1]
        from rlsys.models.tiny import NAMED_SIZES, ensure_tiny_model

        if name not in NAMED_SIZES:
            known = ", ".join(f"rlsys:{n}" for n in NAMED_SIZES)
            raise ModelSpecError(f"model.ckpt {ckpt!r}: no such built-in model; built-in: {known}")
        return str(ensure_tiny_model(**NAMED_SIZES[name]))
    path = Path(ckpt).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            from rlsys.lora import ensure_merged_folder

            return str(ensure_merged_folder(path))
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"model.ckpt {ckpt!r}: folder has no config.json (not a Hugging Face model folder)")
        return str(path.resolve())
    if path.suffix == ".gguf" and path.is_file():
        from rlsys.models.gguf import ensure_gguf_folder

        return str(ensure_gguf_folder(path))
    if path.exists() or ckpt.startswith((".", "/", "~")) or ckpt.count("/") > 1 or path.suffix == ".gguf":
        raise ModelSpecError(f"model.ckpt {ckpt!r}: not found (expected a model folder, a .gguf file or a hub id)")
    return ckpt  # a hub id such as Qwen/Qwen2.5-0.5B-Instruct
