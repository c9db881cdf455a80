"""Where the job's actors go: the learner, the rollout actors (engine + proxy) and the env workers.

CPU (no GPU in the cluster): every actor with `num_gpus=0`, weights through the object store.
The GPU layout (placement group with a `{"GPU": 1, "CPU": k}` bundle per GPU, fractional `num_gpus`
shared by learner and engine, CUDA IPC) plugs in here without touching the driver.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

import ray

from actors.env_worker import EnvWorker
from actors.learner import Learner
from actors.rollout import RolloutWorker
from rlsys.config import Config


@dataclass
class Placement:
    learner: Any
    rollouts: list[Any]
    env_workers: list[Any]
    transport: str  # "object_store" | "cuda_ipc"
    canary_tol: float  # default tolerance of the canary for this layout's dtype


def make_env_workers(cfg: Config, **options: Any) -> list[Any]:
    env_cls = ray.remote(EnvWorker)
    retries = 1 if cfg.env.retry_failed_worker else 0
    return [
        env_cls.options(name=f"env-{i}", num_cpus=0, max_restarts=-1, max_task_retries=retries,
                        max_concurrency=cfg.env.max_concurrency, **options).remote(
            cfg.env.agent_fn, cfg.env.reward_fn_path, agent_timeout_s=cfg.env.agent_timeout_s,
            reward_timeout_s=cfg.env.reward_timeout_s)
        for i in range(cfg.env.num_workers)
    ]


def place_actors(cfg: Config, model_path: str) -> Placement:
    if int(ray.cluster_resources().get("GPU", 0)):
        raise RuntimeError("GPU placement arrives with the vLLM engine; run on a machine without GPUs for now")
    # learner and engine take turns (rollout, then train), so each may use every core in its phase
    threads = max(1, os.cpu_count() or 1)
    token = secrets.token_urlsafe(24)
    learner = ray.remote(Learner).options(name="learner-0", num_cpus=0).remote(cfg, model_path, num_threads=threads)
    rollout = ray.remote(RolloutWorker).options(name="rollout-0", num_cpus=0, max_concurrency=1024).remote(
        cfg, model_path, api_token=token, num_threads=threads)
    return Placement(learner=learner, rollouts=[rollout], env_workers=make_env_workers(cfg),
                     transport="object_store", canary_tol=1e-4)
