"""The job's Ray session: start (or join) Ray in the job's namespace, wait out a previous run's actors, and export
the job's gauges.

Actors are named (`rollout-0`, `learner-0`, `env-<i>`) in a per-job namespace (`job_namespace`), so the dashboard's
Actors page and `ray list actors` show what is what, and a restarted job (`--resume auto`) finds its own.
"""
from __future__ import annotations

import importlib
import os
import re
import threading
from pathlib import Path
from typing import Any

import ray

from rlsys.config import ClusterConfig


def init_ray(cluster: ClusterConfig, namespace: str) -> bool:
    """Join the cluster at `cluster.address` / RAY_ADDRESS, or start an embedded one; True if we own it."""
    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        # under `ray job submit` the job's working_dir carries actors/ and jobs/ to every worker
        ray.init(address=address, namespace=namespace, log_to_driver=True)
        return False
    pythonpath = os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", namespace=namespace, num_cpus=cluster.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}},
             log_to_driver=True)
    return True


def import_meanwhile(name: str) -> None:
    """Start importing module ``name`` on a thread and return: a later ``import`` of it waits for that one (the
    import system's per-module lock) or, if it failed, imports it again and raises its error where it is used.
    The driver's torch import (~3-5 s, through the actors' modules) thus overlaps Ray's start, which mostly
    waits on its processes."""
    def run() -> None:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001,S110 (the import that needs it raises it again, where it is used)
            pass

    threading.Thread(target=run, name=f"import {name}", daemon=True).start()


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def wait_for_stale_actors(namespace: str, timeout_s: float = 60.0) -> None:
    """A restarted job (after a crash, `--resume auto`) reuses its namespace; Ray reaps the dead driver's
    named actors within seconds. Wait for that instead of failing on a taken name."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        if not alive:
            return
        if time.monotonic() > deadline:
            names = ", ".join(a["name"] for a in alive)
            raise RuntimeError(f"namespace {namespace!r} still has actors {names} from another run of this job; "
                               "is it still running? (set cluster.namespace to run both)")
        time.sleep(0.5)


def job_namespace(namespace: str | None, run_dir: str) -> str:
    """`cluster.namespace` if set, else one named after the run directory (so a resumed run finds its own)."""
    if namespace:
        return namespace
    return "rlsys-" + re.sub(r"[^A-Za-z0-9_.-]", "-", Path(run_dir).name)


class RayGauges:
    """`ray.util.metrics` gauges (exported for Prometheus; graphs need Prometheus + Grafana, see
    docs/gpu.md, "What rlsys relies on"), tagged with the job's namespace."""

    EXPORTED = {"step": "rlsys_step", "rollout/rewards_mean": "rlsys_reward_mean",
                "perf/tokens_per_s": "rlsys_tokens_per_s", "time/sync": "rlsys_refit_seconds",
                "time/step": "rlsys_step_seconds", "rollout/failed_frac": "rlsys_failed_frac"}

    def __init__(self, namespace: str) -> None:
        from ray.util.metrics import Gauge

        self.tags = {"job": namespace}
        self.gauges = {key: Gauge(name, description=f"rlsys {key}", tag_keys=("job",))
                       for key, name in self.EXPORTED.items()}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = step + 1 if key == "step" else metrics.get(key)
            if isinstance(value, (int, float)):
                gauge.set(float(value), tags=self.tags)
