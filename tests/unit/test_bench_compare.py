"""`python -m jobs.bench compare`: bench step results side by side, on the H200 runs kept in docs/data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "docs" / "data" / "gpu-2026-12-01c"


def test_compare_lists_each_run_with_throughput_multiples_of_the_first(capsys):
    from jobs.bench import main

    sleep, graphs = DATA / "bench-step-sleep.json", DATA / "bench-step-graphs.json"
    assert main(["compare", f"asleep={sleep}", f"graphs={graphs}"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| | asleep | graphs |"
    rows = {line.split(" | ")[0].strip("| ").strip(): line for line in table[2:]}
    a, g = (json.loads(p.read_text()) for p in (sleep, graphs))
    ratio = g["tokens_per_s_rollout"]["median"] / a["tokens_per_s_rollout"]["median"]
    assert f"({ratio:.2f}x)" in rows["rollout tokens/s"] and "(1.00x)" in rows["rollout tokens/s"]
    step_ratio = a["phases"]["step"]["median"] / g["phases"]["step"]["median"]
    assert f"({step_ratio:.2f}x)" in rows["steps/s"]
    assert f"{g['phases']['push']['median']:.4f}" in rows["refit (push)"]
    assert "55.2" in rows["peak GiB per GPU"]  # no per-GPU sampler in these runs: the job's device peak


def test_compare_shows_per_gpu_peaks_and_layout_when_recorded(tmp_path):
    from jobs.bench_step import compare_table

    run = json.loads((DATA / "bench-step-auto.json").read_text())
    run.update(layout={"world_size": 2, "tp_size": 1}, gpu_peak_gib=[31.25, 30.5])
    out = compare_table([("one GPU", json.loads((DATA / "bench-step-auto.json").read_text())), ("ws2", run)])
    assert "| GPUs (world size x tp) | ? x tp ? | 2 x tp 1 |" in out
    assert "31.2 / 30.5 |" in out


def test_compare_refuses_a_malformed_run_spec(capsys):
    from jobs.bench import main

    with pytest.raises(SystemExit):
        main(["compare", "no-equals-sign"])
    assert "is not NAME=FILE.json" in capsys.readouterr().err


def test_the_gpu_sampler_keeps_each_process_peak_and_the_device_peak_without_per_process_support():
    """What calibrates the estimate's fixed memory per process: NVML's per-process use, peaked over samples; a
    device whose driver refuses per-process queries still gives the device's peak."""
    import os
    from types import SimpleNamespace

    from jobs.bench_step import GIB, GpuPeakSampler

    readings = iter([(10 * GIB, [(os.getpid(), 4 * GIB), (999_999_999, 6 * GIB)]),
                     (12 * GIB, [(os.getpid(), 5 * GIB), (999_999_999, None)]),
                     (11 * GIB, RuntimeError("NVML_ERROR_NOT_SUPPORTED"))])
    now = {}

    def memory(handle):
        now["used"], now["procs"] = next(readings)
        return SimpleNamespace(used=now["used"])

    def processes(handle):
        if isinstance(now["procs"], Exception):
            raise now["procs"]
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in now["procs"]]

    sampler = GpuPeakSampler()
    sampler._handles, sampler._peaks = ["gpu0"], [0]
    sampler._nvml = SimpleNamespace(nvmlDeviceGetMemoryInfo=memory, nvmlDeviceGetComputeRunningProcesses=processes)
    for _ in range(3):
        sampler.sample()
    assert sampler.peaks_gib() == [12.0]
    assert sampler.process_peaks_gib() == [{"pid": 999_999_999, "peak_gib": 6.0}, {"pid": os.getpid(), "peak_gib": 5.0}]
