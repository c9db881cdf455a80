"""Where the job's actors go: learner ranks, rollout actors (engine + proxy) and env workers.

CPU (no GPU in the cluster): one learner and one engine with `num_gpus=0`, weights through the object store
(or gloo broadcasts with `sync.transport = "collective"`).
GPUs: one placement group with a `{"GPU": 1, "CPU": k}` bundle per GPU of `cluster.world_size`; learner rank r
and engine r share bundle r with fractional `num_gpus` and take turns (rollout, then train), so weights go
by CUDA IPC on one GPU. Bundles may sit on several nodes. vLLM's memory share is not set here: the rollout
actor derives `gpu_memory_utilization` from `rollout.gpu_memory_budget_gib` and the device's size. Env
workers run on CPU, outside the bundles, on the node of the engine they call.
The driver sees the same `Placement` either way; Ray with fake GPUs (`num_gpus` on a CPU box) exercises
the GPU layout on CPU with the transformers engine and the object store (tests/loop/test_scale_out.py).
How weights travel is chosen per engine from where its source rank and it actually landed
(`choose_transport`, called by the driver once the engines report their device).
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
from actors.rollout import RolloutWorker
from rlsys.config import Config
from rlsys.errors import UserInputError

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
    learners: list[Any]  # learner ranks, rank r on GPU bundle r
    rollouts: list[Any]  # engines (+ proxies), one per `tp_size` GPUs
    sources: list[int]  # (E,) the learner rank on each engine's GPU: where its weights come from
    canary_tol: float  # default tolerance of the canary for this layout's dtype
    placement_group: Any = None  # GPU layout: the group holding the bundles (removed at shutdown)


def make_env_workers(cfg: Config, nodes: list[str | None], **options: Any) -> list[Any]:
    """Env workers, at least one per engine, each pinned to the node of the engine it calls (worker i ->
    engine i mod E), so agent traffic stays on loopback."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env_cls = ray.remote(EnvWorker)
    retries = 1 if cfg.env.retry_failed_worker else 0
    workers = []
    for i in range(max(cfg.env.num_workers, len(nodes))):
        node = nodes[i % len(nodes)]
        where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
        workers.append(env_cls.options(
            name=f"env-{i}", num_cpus=0, max_restarts=-1, max_task_retries=retries,
            max_concurrency=cfg.env.max_concurrency, **where, **options).remote(
            cfg.env.agent_fn, cfg.env.reward_fn_path, agent_timeout_s=cfg.env.agent_timeout_s,
            reward_timeout_s=cfg.env.reward_timeout_s))
    return workers


def place_actors(cfg: Config, model_path: str) -> Placement:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus:
        return place_on_gpus(cfg, model_path, gpus)
    if cfg.cluster.world_size > 1:
        raise UserInputError(f"cluster.world_size={cfg.cluster.world_size} counts GPUs, and this Ray cluster has "
                             "none; on CPU use world_size 1")
    # learner and engine take turns (rollout, then train), so each may use every core in its phase
    threads = max(1, os.cpu_count() or 1)
    token = secrets.token_urlsafe(24)
    learner = ray.remote(Learner).options(name="learner-0", num_cpus=0).remote(cfg, model_path, num_threads=threads)
    rollout = ray.remote(RolloutWorker).options(name="rollout-0", num_cpus=0, max_concurrency=1024).remote(
        cfg, model_path, api_token=token, num_threads=threads, transport=cfg.sync.transport)
    half = cfg.model.dtype in ("bfloat16", "float16")  # "auto" is float32 on CPU
    return Placement(learners=[learner], rollouts=[rollout], sources=[0],
                     canary_tol=BF16_CANARY_TOL if half else FP32_CANARY_TOL)


def place_on_gpus(cfg: Config, model_path: str, available: int) -> Placement:
    """One placement group, one `{"GPU": 1, "CPU": k}` bundle per GPU of `cluster.world_size`: learner rank r
    and (with tp_size 1) engine r share bundle r, so every push stays on one GPU (CUDA IPC). Bundles may
    land on several nodes (`cluster.placement_strategy` PACK/SPREAD); an engine is always on its rank's node."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    c = cfg.cluster
    if c.tp_size != 1:
        raise NotImplementedError(
            f"cluster.tp_size={c.tp_size}: tensor-parallel engines (vLLM's Ray executor inside the placement "
            "group) are not built yet; use tp_size 1 (one engine per GPU)"
        )
    if c.world_size > available:
        raise UserInputError(f"cluster.world_size={c.world_size} but the Ray cluster has {available} GPU(s)")
    pg = placement_group([{"GPU": 1, "CPU": c.cpus_per_bundle}] * c.world_size, strategy=c.placement_strategy,
                         name=f"rlsys-{secrets.token_hex(3)}")
    ray.get(pg.ready(), timeout=120)
    runtime_env = {"env_vars": gpu_actor_env()}
    token = secrets.token_urlsafe(24)
    learners, rollouts = [], []
    for rank in range(c.world_size):
        in_bundle = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
        learners.append(ray.remote(Learner).options(
            name=f"learner-{rank}", num_cpus=0, num_gpus=LEARNER_GPU_SHARE, scheduling_strategy=in_bundle,
            runtime_env=runtime_env).remote(cfg, model_path))
        rollouts.append(ray.remote(RolloutWorker).options(
            name=f"rollout-{rank}", num_cpus=0, num_gpus=ROLLOUT_GPU_SHARE, max_concurrency=1024,
            scheduling_strategy=in_bundle, runtime_env=runtime_env).remote(
            cfg, model_path, api_token=token, transport=cfg.sync.transport))
    bf16 = cfg.model.dtype in ("auto", "bfloat16", "float16")
    return Placement(learners=learners, rollouts=rollouts, sources=list(range(c.world_size)),
                     canary_tol=BF16_CANARY_TOL if bf16 else FP32_CANARY_TOL, placement_group=pg)


def gpu_actor_env() -> dict[str, str]:
    """GPU_ACTOR_ENV plus the repo on PYTHONPATH: vLLM's engine core imports actors.vllm_ext by name."""
    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(dict.fromkeys(filter(None, [repo, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))
    return {**GPU_ACTOR_ENV, "PYTHONPATH": path}


def choose_transport(requested: str, learner: dict[str, Any], engine: dict[str, Any]) -> tuple[str, str]:
    """(transport, why) for one engine fed by one learner rank. ``learner`` / ``engine``: where the weights
    live, {"node_id", "gpu_ids" (Ray's), "on_gpu"} (`Learner.device_where`, `RolloutWorker.start`).

    `auto`: both on GPUs and on the same one (same node, same single GPU id) -> cuda_ipc; both on GPUs
    elsewhere (another GPU or node) -> collective (NCCL broadcast); otherwise (CPU, or a CPU engine) ->
    object_store. An explicit `cuda_ipc` falls back to object_store without GPUs (as the CPU layout always did)
    and is refused for learner and engine on different GPUs, here rather than at the first push.
    """
    on_gpus = bool(learner.get("on_gpu")) and bool(engine.get("on_gpu"))
    same_node = learner.get("node_id") == engine.get("node_id")
    gpus = list(learner.get("gpu_ids") or [])
    same_gpu = on_gpus and same_node and len(gpus) == 1 and gpus == list(engine.get("gpu_ids") or [])
    where = ("the same GPU" if same_gpu else "different GPUs on one node" if on_gpus and same_node
             else "different nodes" if on_gpus else "CPU (learner or engine not on a GPU)")
    if requested == "auto":
        if same_gpu:
            return "cuda_ipc", where
        return ("collective", where + ": NCCL broadcast") if on_gpus else ("object_store", where)
    if requested == "cuda_ipc" and not on_gpus:  # as before: the CPU layout has no CUDA to share
        return "object_store", f"{where}: cuda_ipc needs CUDA, weights go through the object store"
    if requested == "cuda_ipc" and not same_gpu:
        raise UserInputError(f"sync.transport=cuda_ipc needs learner and engine on one GPU, but they are on {where}; "
                             "use auto (chooses collective or object_store) or collective")
    if requested == "collective" and same_gpu:  # NCCL refuses two ranks on one device ("Duplicate GPU detected")
        raise UserInputError("sync.transport=collective broadcasts between GPUs, but learner and engine share one "
                             "GPU; use auto (cuda_ipc there) or cuda_ipc")
    backend = " (nccl)" if on_gpus else " (gloo)"
    return requested, f"{where}, as configured" + (backend if requested == "collective" else "")
