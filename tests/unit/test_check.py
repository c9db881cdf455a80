"""`rlsys check`: pure planning on made-up machines, the probes on this one, and that it starts nothing."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.check import GPU, Cluster, Machine, cluster_warnings, gcs_host_port, main, plan_job, reachable
from rlsys.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CPU_BOX = Machine(torch="2.13.0+cpu", packages={"ray": "2.60.0", "vllm": None, "bitsandbytes": None})
GPU_BOX = Machine(torch="2.11.0+cu130", torch_cuda="13.0", cuda_available=True,
                  gpus=[GPU(0, "NVIDIA H200", 139.0, 139.8)],
                  packages={"ray": "2.60.0", "vllm": "0.26.0", "bitsandbytes": "0.50.2"})


def test_default_job_on_cpu_is_transformers_adamw_object_store_float32():
    plan, warnings = plan_job(load_config(), CPU_BOX)
    assert (plan.engine, plan.optimizer, plan.transport, plan.dtype) == (
        "transformers", "torch.optim.AdamW", "object_store", "float32")
    assert plan.engine_why == "auto: no CUDA" and plan.layout.startswith("CPU:")
    assert warnings == []


def test_default_job_on_a_gpu_with_vllm_is_vllm_cuda_ipc_bfloat16():
    plan, warnings = plan_job(load_config(), GPU_BOX)
    assert (plan.engine, plan.transport, plan.dtype) == ("vllm", "cuda_ipc", "bfloat16")
    assert plan.layout.startswith("GPU: one {GPU: 1, CPU: 1} bundle")
    assert warnings == []


def test_adam_8bit_without_cuda_or_bitsandbytes_warns_and_says_what_to_do():
    plan, warnings = plan_job(load_config(flags={"--adam-8bit": True}), CPU_BOX)
    assert plan.optimizer == "bitsandbytes AdamW8bit"
    assert any("adam_8bit needs CUDA" in w and "--adam-8bit" in w for w in warnings)
    assert any("adam_8bit needs bitsandbytes" in w for w in warnings)


def test_vllm_asked_for_where_it_cannot_run_warns():
    _, warnings = plan_job(load_config(flags={"--engine": "vllm"}), CPU_BOX)
    assert any("vLLM is not installed" in w for w in warnings) and any("needs CUDA" in w for w in warnings)
    no_vllm_gpu = Machine(cuda_available=True, gpus=GPU_BOX.gpus, packages={"vllm": None})
    plan, warnings = plan_job(load_config(flags={"--world-size": "2"}), no_vllm_gpu)
    assert plan.engine == "transformers" and "vLLM not installed" in plan.engine_why
    assert any("world_size=2" in w for w in warnings)


def test_cluster_warnings_name_the_auth_mode_trap_and_a_dead_address():
    c = Cluster(address="127.0.0.1:1", address_source="RAY_ADDRESS", auth_mode=None, token_file=True,
                local_head=None, reachable={"127.0.0.1:1": False})
    warnings = cluster_warnings(c, CPU_BOX)
    assert any("RAY_AUTH_MODE=token" in w for w in warnings)
    assert any("127.0.0.1:1 (RAY_ADDRESS) does not answer" in w for w in warnings)


def test_gcs_address_forms_and_a_real_tcp_probe():
    assert gcs_host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert gcs_host_port("ray://head:10001") == ("head", 10001)
    assert gcs_host_port("auto") is None
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert reachable(f"127.0.0.1:{port}")
    assert not reachable(f"127.0.0.1:{port}", timeout_s=0.5)  # closed now


def test_check_exits_0_and_prints_the_plan(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main([]) == 0
    out = capsys.readouterr().out
    for needle in ("python ", "torch ", "ray ", "RAY_AUTH_MODE", "engine ", "optimizer ", "transport ", "dtype "):
        assert needle in out, needle
    assert main(["--json", "--adam-8bit"]) == 0
    assert '"warnings"' in capsys.readouterr().out


def test_importing_check_imports_neither_ray_nor_vllm():
    code = "import sys, rlsys.check; print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_check_starts_no_ray(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray not installed")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code = "import sys; from rlsys.check import main; main([]); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
