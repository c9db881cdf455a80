"""Where the job's actors go: the learner, the rollout actors (engine + proxy) and the env workers.

CPU (no GPU in the cluster): every actor with `num_gpus=0`, weights through the object store.
GPU: one placement group with a `{"GPU": 1, "CPU": k}` bundle; the learner and the rollout actor (vLLM engine
+ proxy) share that GPU with fractional `num_gpus` and take turns (rollout, then train), so weights go by
CUDA IPC. vLLM's memory share is not set here: the rollout actor derives `gpu_memory_utilization` from
`rollout.gpu_memory_budget_gib` and the device's size. Env workers stay on CPU, outside the bundle.
The driver sees the same `Placement` either way.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.env_worker import EnvWorker
from actors.learner import Learner
from actors.rollout import RolloutWorker, resolve_engine_kind
from rlsys.config import Config

# Learner and engine each take half of the bundle's GPU: Ray only needs the shares to fit in the bundle;
# memory is split by vLLM's budget, not by these numbers.
LEARNER_GPU_SHARE = 0.5
ROLLOUT_GPU_SHARE = 0.5
FP32_CANARY_TOL = 1e-4
# Mean |logp_vllm - logp_learner| over the canary's tokens right after a push, bf16 on both sides: vLLM's
# fused kernels and transformers' differ in rounding only. Measured on the H200 (docs/gpu.md): 0.001-0.0026
# (tiny model), 0.0079 (random 0.5B); a push skipped after four training steps read 3.8.
BF16_CANARY_TOL = 2e-2
# Environment of every GPU actor (the engine core that vLLM spawns inherits it):
# - VLLM_ALLOW_INSECURE_SERIALIZATION: lets collective_rpc carry pickled objects (TRAPS.md).
# - VLLM_USE_FLASHINFER_SAMPLER=0: skips ~110 s of FlashInfer JIT at every cold engine start (TRAPS.md).
GPU_ACTOR_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


@dataclass
class Placement:
    learner: Any
    rollouts: list[Any]
    env_workers: list[Any]
    transport: str  # "object_store" | "cuda_ipc"
    canary_tol: float  # default tolerance of the canary for this layout's dtype
    placement_group: Any = None  # GPU layout: the group holding the bundles (kept for the job's lifetime)


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
        return place_on_gpu(cfg, model_path)
    # learner and engine take turns (rollout, then train), so each may use every core in its phase
    threads = max(1, os.cpu_count() or 1)
    token = secrets.token_urlsafe(24)
    learner = ray.remote(Learner).options(name="learner-0", num_cpus=0).remote(cfg, model_path, num_threads=threads)
    rollout = ray.remote(RolloutWorker).options(name="rollout-0", num_cpus=0, max_concurrency=1024).remote(
        cfg, model_path, api_token=token, num_threads=threads, transport="object_store")
    return Placement(learner=learner, rollouts=[rollout], env_workers=make_env_workers(cfg),
                     transport="object_store", canary_tol=FP32_CANARY_TOL)


def place_on_gpu(cfg: Config, model_path: str) -> Placement:
    """One `{"GPU": 1, "CPU": k}` bundle shared by the learner and the rollout actor."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    c = cfg.cluster
    if c.world_size != 1 or c.tp_size != 1:
        raise NotImplementedError(
            f"cluster.world_size={c.world_size}, tp_size={c.tp_size}: the GPU layout places one learner and one "
            "engine on one GPU for now (multi-GPU learner ranks and tensor-parallel engines are not built yet)"
        )
    pg = placement_group([{"GPU": 1, "CPU": c.cpus_per_bundle}] * c.world_size, strategy=c.placement_strategy,
                         name=f"rlsys-{secrets.token_hex(3)}")
    ray.get(pg.ready(), timeout=120)
    in_bundle = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    runtime_env = {"env_vars": gpu_actor_env()}
    kind = resolve_engine_kind(cfg)
    transport = cfg.sync.transport
    if transport == "auto":
        transport = "cuda_ipc" if kind == "vllm" else "object_store"
    token = secrets.token_urlsafe(24)
    learner = ray.remote(Learner).options(
        name="learner-0", num_cpus=0, num_gpus=LEARNER_GPU_SHARE, scheduling_strategy=in_bundle,
        runtime_env=runtime_env).remote(cfg, model_path)
    rollout = ray.remote(RolloutWorker).options(
        name="rollout-0", num_cpus=0, num_gpus=ROLLOUT_GPU_SHARE, max_concurrency=1024,
        scheduling_strategy=in_bundle, runtime_env=runtime_env).remote(
        cfg, model_path, api_token=token, transport=transport)
    bf16 = cfg.model.dtype in ("auto", "bfloat16", "float16")
    return Placement(learner=learner, rollouts=[rollout], env_workers=make_env_workers(cfg), transport=transport,
                     canary_tol=BF16_CANARY_TOL if bf16 else FP32_CANARY_TOL, placement_group=pg)


def gpu_actor_env() -> dict[str, str]:
    """GPU_ACTOR_ENV plus the repo on PYTHONPATH: vLLM's engine core imports actors.vllm_ext by name."""
    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(dict.fromkeys(filter(None, [repo, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))
    return {**GPU_ACTOR_ENV, "PYTHONPATH": path}
