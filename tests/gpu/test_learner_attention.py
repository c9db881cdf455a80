"""The learner's attention backward stays finite where PyTorch's cuDNN kernel is not (`learner.cudnn_attention`).

On the H200 with torch 2.11, cuDNN's scaled-dot-product-attention backward returned NaN query gradients for an
explicit mask, a length of 64 mod 128 and rows whose logsumexp is below ln(float32 max) (scripts/probe_sdpa_nan.py;
the gsm runs' skipped steps). A learner with the default config must leave cuDNN's kernel out, so that the same
inputs give finite gradients; with `learner.cudnn_attention=true` the kernel stays allowed (its NaN count is
measured, not asserted: it depends on the torch and cuDNN of the machine).
"""
from __future__ import annotations

import pytest

from scripts.probe_sdpa_nan import attention_alone
from tests.gpu.conftest import learner_on_gpu, measure, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu, pytest.mark.timeout(300)]


@pytest.fixture
def restore_cudnn_sdp():
    import torch

    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize("cudnn", [False, True], ids=["default", "cudnn"])
def test_learner_attention_backward_is_finite(gpu_tiny_path, restore_cudnn_sdp, cudnn):
    import torch

    from rlsys.config import load_config

    torch.backends.cuda.enable_cudnn_sdp(True)  # PyTorch's default, whatever an earlier test left
    cfg = load_config(overrides=[f"learner.cudnn_attention={str(cudnn).lower()}"])
    with learner_on_gpu(cfg, gpu_tiny_path):
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
        found = attention_alone(torch, [640, 704, 768])
    for r in found:
        measure(f"sdpa_grad_q_nonfinite_{'cudnn' if cudnn else 'default'}_{r['length']}", r["grad_q_nonfinite"])
        assert r["out_nonfinite"] == 0, r
        if not cudnn:
            assert r["grad_q_nonfinite"] == 0 and r["grad_k_nonfinite"] == 0, r
