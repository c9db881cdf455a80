"""Generation engines behind one interface (``Engine`` in base.py), built by ``make_engine``.

Implementations are imported lazily inside ``make_engine``: ``import rlsys.engines`` must work on a
machine without vLLM (CPU, CI) and must not pay for importing transformers until an engine is built.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from rlsys.engines.base import Engine, GenerateOutput, SamplingParams

ENGINE_KINDS = ("transformers", "vllm")


def make_engine(kind: str, /, *args: Any, **kwargs: Any) -> Engine:
    """Build an engine by kind; ``args``/``kwargs`` go to its constructor (model path first).

    ``"transformers"``: ``TransformersEngine`` (CPU or GPU). ``"vllm"``: the vLLM engine in
    ``rlsys.engines.vllm_engine`` (GPU; needs the ``[gpu]`` extra).
    """
    if kind == "transformers":
        from rlsys.engines.transformers_engine import TransformersEngine  # noqa: PLC0415

        return TransformersEngine(*args, **kwargs)
    if kind == "vllm":
        from rlsys.engines.vllm_engine import VLLMEngine  # noqa: PLC0415 (imports vllm)

        return VLLMEngine(*args, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {list(ENGINE_KINDS)}")


def resolve_engine_kind(kind: str, gpu_visible: Callable[[], bool]) -> str:
    """`rollout.engine` (``kind``), with `auto` = vLLM where vLLM is installed and ``gpu_visible()`` says the
    process sees a GPU, else transformers. The rollout actor asks torch (`torch.cuda.is_available`); the driver's
    checks, which do not import torch, ask NVML."""
    if kind != "auto":
        return kind
    return "vllm" if importlib.util.find_spec("vllm") is not None and gpu_visible() else "transformers"


__all__ = ["ENGINE_KINDS", "Engine", "GenerateOutput", "SamplingParams", "make_engine", "resolve_engine_kind"]
