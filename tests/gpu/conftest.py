"""GPU tests: vLLM rollout, CUDA IPC weight push, sleep/wake, the job on the GPU. Run on the GPU machine.

Modules marked `gpu` skip (with the reason) where CUDA or vLLM is missing; nothing here imports vLLM at
collection time. The tiny model for these tests has head_dim 64 (hidden 256, 4 heads, 2 KV heads): the
default tiny model's head_dim 32 is not one every vLLM attention backend serves.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_TINY_SIZES = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}


def gpu_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA (run on the GPU machine)"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM (pip install 'rlsys[gpu]')"
    return None


requires_gpu = pytest.mark.skipif(gpu_skip_reason() is not None, reason=gpu_skip_reason() or "")


@pytest.fixture(scope="session")
def gpu_tiny_path() -> str:
    from rlsys.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model(**GPU_TINY_SIZES))


@pytest.fixture(scope="session", autouse=True)
def _vllm_env():
    # the engine core vLLM spawns inherits these (docs/gpu.md, "What rlsys relies on": IPC handles through
    # collective_rpc, FlashInfer JIT)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    yield


@contextlib.contextmanager
def learner_on_gpu(cfg, model_path: str):
    """The job's `Learner` of ``cfg`` (bf16 on the GPU), its CUDA memory released afterwards."""
    import torch

    from tests.conftest import make_learner

    lrn = make_learner(cfg, model_path)
    assert lrn.device.type == "cuda" and lrn.dtype == torch.bfloat16
    try:
        yield lrn
    finally:
        del lrn
        torch.cuda.empty_cache()


def measure(name: str, value: float) -> None:
    """One measured number in the test log (pytest -s), greppable as `MEASURE name=value`."""
    print(f"MEASURE {name}={value:.6g}", flush=True)
