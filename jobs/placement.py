"""Where the job's actors go: learner ranks, rollout actors (engine + proxy) and env workers.

CPU (no GPU in the cluster): one learner and one engine with `num_gpus=0`, weights through the object store
(or gloo broadcasts with `sync.transport = "collective"`).
GPUs: one placement group with a `{"GPU": 1, "CPU": k}` bundle per GPU of `cluster.world_size`; learner rank r
and engine r share bundle r with fractional `num_gpus` and take turns (rollout, then train), so weights go
by CUDA IPC on one GPU. With `cluster.tp_size` T > 1 engine e spans bundles e*T .. e*T+T-1 through vLLM's Ray
executor (one vLLM worker actor per bundle, beside that bundle's learner rank), and each worker gets the CUDA
IPC handles of the rank on its GPU. Bundles may sit on several nodes. vLLM's memory share is not set here: the rollout
actor derives `gpu_memory_utilization` from `rollout.gpu_memory_budget_gib` and the device's size. Env
workers run on CPU, outside the bundles, on the node of the engine they call.
The driver sees the same `Placement` either way; Ray with fake GPUs (`num_gpus` on a CPU box) exercises
the GPU layout on CPU with the transformers engine and the object store (tests/loop/test_scale_out.py).
How weights travel is chosen per engine from where its source rank and it actually landed
(rlsys/weights/routes.py `plan_routes`, called by the driver once the engines report their workers' devices).
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from actors.env_worker import EnvWorker
from actors.learner import Learner, LearnerSettings
from actors.reference import Reference
from actors.rollout import EngineSettings, RolloutWorker
from rlsys.config import Config, EnvConfig, LearnerConfig, ModelConfig
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
# `learner.fp32_master`: the learner computes from fp32 weights under bf16 autocast (each op rounds its inputs),
# the engine from the same weights rounded once to bf16 at the push, so a healthy job reads more: 0.025-0.085 on
# the H200 with Qwen2.5-0.5B (docs/gpu.md, docs/results.md), against ~3.8 for a skipped push.
AUTOCAST_CANARY_TOL = 0.15
# LoRA: float32 adapters on the learner's bf16 base against their bf16 merge in the engine take AUTOCAST_CANARY_TOL.
# Measured on the H200 (docs/gpu.md, 2026-12-03): 0.0012-0.0019 on the tiny model, 0.011-0.053 (median 0.025) through
# the 83 steps of a Qwen2.5-0.5B LoRA job. A 4-bit learner base against vLLM's bf16 one adds the quantization error:
# 0.03-0.05 on the tiny model, 1.18 on a random-weight 7B-shaped model (whose flat distributions magnify it), so
# this stays a guess between the two until a trained model is measured.
LORA_4BIT_CANARY_TOL = 0.5
# Environment of every GPU actor (the engine core that vLLM spawns inherits it):
# - VLLM_ALLOW_INSECURE_SERIALIZATION: lets collective_rpc carry pickled objects (docs/gpu.md, "What rlsys relies on").
# - VLLM_USE_FLASHINFER_SAMPLER=0: skips ~110 s of FlashInfer JIT at every cold engine start (same section).
GPU_ACTOR_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


@dataclass
class Placement:
    learners: list[Any]  # learner ranks, rank r on GPU bundle r
    rollouts: list[Any]  # engines (+ proxies), one per `tp_size` GPUs
    sources: list[int]  # (E,) the learner rank on each engine's (first) GPU: where its weights come from
    canary_tol: float  # default tolerance of the canary for this layout's dtype
    canary_follow: bool = True  # the engines' canary must move with the learner's (`canary_follows`)
    placement_group: Any = None  # GPU layout: the group holding the bundles (removed at shutdown)
    feeders: list[list[int]] | None = None  # (E, T) the learner ranks on each engine's GPUs; None = `sources`
    reference: Any = None  # `learner.reference_actor`: the KL reference's own actor (actors/reference.py)


def learner_settings(cfg: Config, model_path: str | None = None) -> LearnerSettings:
    """What a learner rank reads of ``cfg``; with `rollout.gpu_memory_budget_gib`, the budget's split for the
    model at ``model_path`` (computed here once, as each actor computed it before)."""
    from rlsys.budget import budget_split

    budget = cfg.rollout.gpu_memory_budget_gib
    return LearnerSettings(model=cfg.model, learner=cfg.learner, algo=cfg.algo, seed=cfg.seed, max_steps=cfg.max_steps,
                           budget_gib=budget, memory=budget_split(cfg, model_path) if budget is not None else None)


def engine_settings(cfg: Config, model_path: str) -> EngineSettings:
    """What a rollout actor reads of ``cfg``, with the memory its vLLM engine may take (the budget's split, or
    what a fixed `rollout.kv_cache_gib` makes it hold) for the model at ``model_path``."""
    from rlsys.budget import budget_split, fixed_kv_engine_bytes

    r = cfg.rollout
    memory = budget_split(cfg, model_path)
    kv_bytes = fixed_kv_engine_bytes(cfg, model_path) if memory is None and r.kv_cache_gib is not None else None
    return EngineSettings(rollout=r, dtype=cfg.model.dtype, seed=cfg.seed, tp_size=cfg.cluster.tp_size,
                          ray_executor=cfg.vllm_ray_executor(), memory=memory, kv_engine_bytes=kv_bytes,
                          lora=cfg.learner.lora if cfg.learner.lora.enabled else None)


def make_env_workers(env: EnvConfig, nodes: list[str | None], name: str = "env", **options: Any) -> list[Any]:
    """Env workers (`{name}-{i}`), at least one per engine, each pinned to the node of the engine it calls
    (worker i -> engine i mod E), so agent traffic stays on loopback."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    env_cls = ray.remote(EnvWorker)
    retries = 1 if env.retry_failed_worker else 0
    workers = []
    cpus = node_cpus()
    count = max(env.worker_count([cpus.get(n, 0.0) if n else 0.0 for n in dict.fromkeys(nodes)]), len(nodes))
    for i in range(count):
        node = nodes[i % len(nodes)]
        where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
        workers.append(env_cls.options(
            name=f"{name}-{i}", num_cpus=0, max_restarts=-1, max_task_retries=retries,
            max_concurrency=env.max_concurrency, **where, **options).remote(
            env.agent_fn, env.reward_fn_path, env_name=env.name, agent_timeout_s=env.agent_timeout_s,
            reward_timeout_s=env.reward_timeout_s, max_concurrency=env.max_concurrency))
    return workers


def node_cpus() -> dict[str, float]:
    """CPUs per alive node of the Ray cluster."""
    return {n["NodeID"]: n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")}


def place_actors(cfg: Config, model_path: str) -> Placement:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and cfg.learner.reference_actor:
        raise UserInputError("learner.reference_actor: CPU jobs only for now (on GPUs the learner runs the KL "
                             "reference); turn it off")
    if gpus:
        return place_on_gpus(cfg, model_path, gpus)
    if cfg.cluster.world_size > 1:
        raise UserInputError(f"cluster.world_size={cfg.cluster.world_size} counts GPUs, and this Ray cluster has "
                             "none; on CPU use world_size 1")
    # learner and engine take turns (rollout, then train), so each may use every core in its phase; under
    # rollout.overlap they run at once, and the learner leaves the engine's threads their cores (on 2 cores, both
    # at 2 threads made the overlapped step slower than the two in turn: 1.55 s against 1.29 s)
    threads = max(1, os.cpu_count() or 1)
    learner_threads = max(1, threads - (cfg.rollout.engine_threads or 1)) if cfg.rollout.overlap else threads
    token = secrets.token_urlsafe(24)
    learner = ray.remote(Learner).options(name="learner-0", num_cpus=0).remote(
        learner_settings(cfg, model_path), model_path, num_threads=learner_threads)
    rollout = ray.remote(RolloutWorker).options(name="rollout-0", num_cpus=0, max_concurrency=1024).remote(
        engine_settings(cfg, model_path), model_path, api_token=token, num_threads=threads)
    # the reference's forward follows the engine's batch (under overlap both beside the learner): the engine's threads.
    # It holds nothing but the frozen model, so a process that dies is started again and its call retried
    reference = None
    if cfg.learner.reference_actor:
        ref_threads = max(1, threads - learner_threads) if cfg.rollout.overlap else threads
        options = {"name": "reference-0", "num_cpus": 0, "max_restarts": 2, "max_task_retries": 2}
        reference = ray.remote(Reference).options(**options).remote(learner_settings(cfg), num_threads=ref_threads)
    return Placement(learners=[learner], rollouts=[rollout], sources=[0], reference=reference,
                     canary_tol=canary_tolerance(cfg.model, cfg.learner, gpu=False),
                     canary_follow=canary_follows(cfg.model, cfg.learner, gpu=False))


def engine_bundles(world_size: int, tp_size: int) -> list[list[int]]:
    """The GPU bundles of each engine: engine e spans bundles e*T .. e*T+T-1, whose learner ranks feed it."""
    return [list(range(e * tp_size, (e + 1) * tp_size)) for e in range(world_size // tp_size)]


def rollout_placement(ray_workers: bool, pg: Any, bundles: list[int]) -> dict[str, Any]:
    """Ray options of the rollout actor of the engine on ``bundles``. With vLLM's workers in the actor's own
    engine process (tp_size 1): a share of the bundle's GPU, next to the learner. With vLLM's Ray executor
    (``ray_workers``: `Config.vllm_ray_executor`): no GPU for the actor itself (it runs the scheduler and the
    proxy); its placement group is captured by the tasks it starts, and `VLLM_RAY_BUNDLE_INDICES` /
    `VLLM_RAY_PER_WORKER_GPUS` put one vLLM worker on each of the engine's bundles with the engine's share of
    that GPU, beside that bundle's learner rank (vLLM's examples/offline_inference/rlhf_colocate.py)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = gpu_actor_env()
    if ray_workers:
        env.update(VLLM_RAY_BUNDLE_INDICES=",".join(map(str, bundles)), VLLM_RAY_PER_WORKER_GPUS=str(ROLLOUT_GPU_SHARE))
    return {"num_gpus": 0 if ray_workers else ROLLOUT_GPU_SHARE, "runtime_env": {"env_vars": env},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundles[0],
                placement_group_capture_child_tasks=ray_workers)}


def place_on_gpus(cfg: Config, model_path: str, available: int) -> Placement:
    """One placement group, one `{"GPU": 1, "CPU": k}` bundle per GPU of `cluster.world_size`: learner rank r
    in bundle r; engine e on bundles e*T .. e*T+T-1 (T = `cluster.tp_size`; with T = 1 engine r shares bundle r
    with rank r), so every push stays on one GPU (CUDA IPC, one learner rank per engine worker). Bundles may
    land on several nodes (`cluster.placement_strategy` PACK/SPREAD)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    c = cfg.cluster
    if c.world_size > available:
        raise UserInputError(f"cluster.world_size={c.world_size} but the Ray cluster has {available} GPU(s)")
    if c.tp_size > 1 and c.placement_strategy == "SPREAD":
        raise UserInputError(f"cluster.placement_strategy=SPREAD puts every bundle on another node, but a tensor-"
                             f"parallel engine (tp_size {c.tp_size}) needs its GPUs on one node; use PACK or STRICT_PACK")
    pg = placement_group([{"GPU": 1, "CPU": c.cpus_per_bundle}] * c.world_size, strategy=c.placement_strategy,
                         name=f"rlsys-{secrets.token_hex(3)}")
    ray.get(pg.ready(), timeout=120)
    runtime_env = {"env_vars": gpu_actor_env()}
    token = secrets.token_urlsafe(24)
    learners = [ray.remote(Learner).options(
        name=f"learner-{rank}", num_cpus=0, num_gpus=LEARNER_GPU_SHARE, runtime_env=runtime_env,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank),
    ).remote(learner_settings(cfg, model_path), model_path) for rank in range(c.world_size)]
    feeders = engine_bundles(c.world_size, c.tp_size)  # rank r sits in bundle r
    engine = engine_settings(cfg, model_path)
    rollouts = [ray.remote(RolloutWorker).options(
        name=f"rollout-{e}", num_cpus=0, max_concurrency=1024, **rollout_placement(engine.ray_executor, pg, bundles)
    ).remote(engine, model_path, api_token=token) for e, bundles in enumerate(feeders)]
    return Placement(learners=learners, rollouts=rollouts, sources=[f[0] for f in feeders], feeders=feeders,
                     canary_tol=canary_tolerance(cfg.model, cfg.learner, gpu=True),
                     canary_follow=canary_follows(cfg.model, cfg.learner, gpu=True), placement_group=pg)


def canary_tolerance(model: ModelConfig, learner: LearnerConfig, gpu: bool) -> float:
    """The canary's default tolerance for the job's numerics (`sync.canary_tol` overrides it): float32 on both
    sides, bf16 on both sides, or fp32 master weights under bf16 autocast against a bf16 engine. `model.dtype`
    auto is bfloat16 on a GPU and float32 on CPU."""
    if not _half(model, gpu):
        return FP32_CANARY_TOL
    if learner.lora.enabled:
        return LORA_4BIT_CANARY_TOL if learner.lora.base_4bit else AUTOCAST_CANARY_TOL
    return AUTOCAST_CANARY_TOL if learner.fp32_master else BF16_CANARY_TOL


def canary_follows(model: ModelConfig, learner: LearnerConfig, gpu: bool) -> bool:
    """Whether the engines' canary logprobs must move as far as the learner's between checks (`WeightSync`'s
    `canary_follow`): only where both compute in the same numerics. fp32 masters, and LoRA's float32 adapters merged
    into a 16-bit engine, move in steps the engine's rounded weights may lose."""
    return not learner.fp32_master and not (learner.lora.enabled and _half(model, gpu))


def _half(model: ModelConfig, gpu: bool) -> bool:
    """16-bit weights: `model.dtype` bfloat16/float16, or auto on a GPU."""
    return model.dtype in ("bfloat16", "float16") or (gpu and model.dtype == "auto")


def gpu_actor_env() -> dict[str, str]:
    """GPU_ACTOR_ENV plus the repo on PYTHONPATH: vLLM's engine core imports actors.vllm_ext by name."""
    repo = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(dict.fromkeys(filter(None, [repo, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])))
    return {**GPU_ACTOR_ENV, "PYTHONPATH": path}
