"""The host a benchmark ran on, written into its JSON: the same code read a 7B adapter push of 3.03 ms on one H100
host and 5.21-8.07 ms on another (2026-12-07), and the CPU box's speed drifts between sessions, so a number is
compared with another only beside this record."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any


def host() -> dict[str, Any]:
    """The CPU's model, the cores this process may use, the machine's name, and a fixed pure-Python workload's
    time (the best of 5; a CPU-bound share of a benchmark scales with it)."""
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), "unknown") if cpuinfo.is_file() else platform.processor()
    probe = []
    for _ in range(5):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        probe.append((time.perf_counter() - t) * 1e3)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"hostname": platform.node(), "cpu_model": model or "unknown", "cpus": cpus,
            "python_probe_ms": round(min(probe), 2), "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg")
            else None}


def host_line(record: dict[str, Any]) -> str:
    load = record.get("load_avg_1m")
    return (f"host: {record['cpu_model']}, {record['cpus']} CPUs, Python probe {record['python_probe_ms']:.1f} ms"
            + (f", load {load:.2f}" if load is not None else ""))
