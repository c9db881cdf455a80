"""Rollout actor: one generation engine plus the OpenAI-compatible proxy that agents call.

An async Ray actor: the proxy's uvicorn server runs as a task of the actor's event loop, next to the
engine's batching loop, so agent HTTP traffic and Ray calls (pop a session, sleep, load weights) are
served by the same process without threads fighting over the model. Plain class, testable without Ray.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import time
from typing import Any

import torch

from rlsys.config import RolloutConfig
from rlsys.engines import SamplingParams, make_engine, resolve_engine_kind
from rlsys.errors import UserInputError
from rlsys.proxy.sessions import SessionRecord, SessionRecorder
from rlsys.weights.transport import make_transport

MODEL_NAME = "rlsys-policy"


def session_seed(base_seed: int, session_id: str, turn: int) -> int:
    """Per-turn sampling seed from the job seed and the (deterministic) session id: reruns and resumed
    runs sample the same tokens on CPU, whatever order the requests arrive in."""
    digest = hashlib.blake2b(f"{base_seed}/{session_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What the rollout actor reads of the job's config (jobs/placement.py `engine_settings` takes it from one)."""

    rollout: RolloutConfig
    dtype: str = "auto"  # model.dtype
    seed: int = 0
    tp_size: int = 1  # cluster.tp_size
    ray_executor: bool = False  # Config.vllm_ray_executor: vLLM's workers as Ray actors in the placement group
    memory: Any = None  # the learner/engine split of rollout.gpu_memory_budget_gib (rlsys.memory.BudgetSplit)
    kv_engine_bytes: int | None = None  # with rollout.kv_cache_gib and no budget: what vLLM will hold
    lora: Any = None  # learner.lora (LoraConfig) when on: pushes are adapters, merged or served as `lora.serve` says


def engine_dtype(dtype: str) -> str:
    """vLLM's dtype from `model.dtype` (`auto` = bfloat16 on the GPU, as the learner)."""
    return "bfloat16" if dtype == "auto" else dtype


def build_engine(cfg: EngineSettings, model_path: str, process_context: Any = None):
    """The engine `rollout.engine` asks for; vLLM's memory share comes from `rollout.gpu_memory_budget_gib`,
    its engine-core process from ``process_context`` (`start_engine_core_server`) when given."""
    r = cfg.rollout
    kind = resolve_engine_kind(r.engine, torch.cuda.is_available)
    if kind == "vllm":
        return make_engine("vllm", model_path, max_batch_size=r.engine_max_batch, seed=cfg.seed,
                           dtype=engine_dtype(cfg.dtype), gpu_memory_utilization=engine_memory_fraction(cfg),
                           max_model_len=r.max_model_len, enforce_eager=r.enforce_eager, enable_sleep_mode=True,
                           kv_cache_bytes=None if r.kv_cache_gib is None else int(r.kv_cache_gib * 2**30),
                           tensor_parallel_size=cfg.tp_size, ray_executor=cfg.ray_executor,
                           process_context=process_context, model_runner=r.model_runner,
                           graph_mode=r.graph_mode, lora_adapter=lora_adapter(cfg.lora))
    if cfg.lora is not None and cfg.lora.serve == "adapter":
        raise UserInputError(f"learner.lora.serve = \"adapter\" needs the vLLM engine (vLLM's LoRA layers serve "
                             f"the adapter); rollout.engine {r.engine!r} is the transformers engine here, which merges "
                             "it: set learner.lora.serve = \"merged\"")
    return make_engine(kind, model_path, max_batch_size=r.engine_max_batch, seed=cfg.seed, num_threads=r.engine_threads)


def lora_adapter(lora: Any) -> tuple[int, tuple[str, ...]] | None:
    """The vLLM engine's (rank, target modules) when it serves the adapter itself (`learner.lora.serve`)."""
    if lora is None or lora.serve != "adapter":
        return None
    return lora.rank, tuple(lora.target_modules)


def engine_memory_fraction(cfg: EngineSettings) -> float:
    """vLLM's `gpu_memory_utilization`: with `rollout.gpu_memory_budget_gib`, the engine's share of the job's
    budget (`rlsys.budget.budget_split`, the same split the learner caps itself with); unset, a third of the GPU,
    or with a fixed KV cache (`rollout.kv_cache_gib`) what the engine will hold if that is less. vLLM then sizes
    nothing by it, but refuses to start unless that much is free: a third of the GPU often is not when several
    jobs share it (each takes ~10 GiB with a 0.5B model)."""
    from rlsys.engines.vllm_engine import device_total_bytes, memory_fraction

    total = device_total_bytes()
    if cfg.memory is not None:
        fraction = cfg.memory.engine_fraction(total)
    else:
        fraction = memory_fraction(None, total)
        if cfg.rollout.kv_cache_gib is not None:
            fraction = min(fraction, cfg.kv_engine_bytes / total)
    print(f"rlsys: vLLM gpu_memory_utilization {fraction:.4f} ({fraction * total / 2**30:.2f} GiB of "
          f"{total / 2**30:.1f} GiB)", flush=True)
    return fraction


class EngineClock:
    """Wraps the engine the proxy calls: when the first sample came back, and how long the engine had at least
    one request in flight (`time/generate`, the rollout's generation time) and how many tokens it returned.
    Every other attribute is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.first_sample_at: float | None = None  # time.time() of the first finished generate
        self._in_flight = 0
        self._busy_since = 0.0
        self.busy_s = 0.0
        self.tokens = 0
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        try:
            out = await self._engine.generate(prompt_ids, params)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.busy_s += time.perf_counter() - self._busy_since
        if self.first_sample_at is None:
            self.first_sample_at = time.time()
        self.tokens += len(out.token_ids)
        self.requests += 1
        return out

    def pop_counters(self) -> dict[str, float]:
        """Busy seconds, tokens and requests since the last call (a request still in flight counts so far)."""
        busy = self.busy_s + (time.perf_counter() - self._busy_since if self._in_flight else 0.0)
        if self._in_flight:
            self._busy_since = time.perf_counter()
        out = {"time/generate": busy, "perf/engine_tokens": float(self.tokens), "perf/engine_requests": float(self.requests)}
        self.busy_s, self.tokens, self.requests = 0.0, 0, 0
        return out


class RolloutWorker:
    def __init__(self, cfg: EngineSettings, model_path: str, *, api_token: str | None = None,
                 num_threads: int | None = None, transport: str | None = None) -> None:
        """``transport``: how weights arrive until the driver gives the engine its route (`set_route`, before the
        first push; the route is decided by rlsys/weights/routes.py `plan_routes`): by default the object store,
        which works everywhere."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.model_path = model_path
        self.api_token = api_token or secrets.token_urlsafe(24)
        self.recorder = SessionRecorder()
        self.route = None  # the driver's EngineRoute (`set_route`)
        self.transport = make_transport(transport or "object_store")  # a WeightTransport, the route's from `set_route`
        self.engine = None
        self.server = None

    async def start(self) -> dict[str, Any]:
        """Build the engine and start the proxy inside this event loop; returns how agents reach it."""
        began = time.time()
        self._engine_kind = resolve_engine_kind(self.cfg.rollout.engine, torch.cuda.is_available)
        process_context = None
        if self._engine_kind == "vllm":
            from rlsys.engines.vllm_engine import export_ray_address, model_architectures, start_engine_core_server

            export_ray_address()  # the engine core (and vLLM's Ray workers) join this job's Ray and placement group
            if self.cfg.rollout.engine_process == "forkserver":
                # the server imports vLLM (and the model's vLLM module) for the engine core while we import vLLM too
                process_context = start_engine_core_server(architectures=model_architectures(self.model_path))
        from transformers import AutoTokenizer

        from rlsys.proxy.server import ProxyServer, create_app

        self.engine = build_engine(self.cfg, self.model_path, process_context)
        if self.cfg.lora is not None:
            await self.engine.set_lora(self.cfg.lora.scale())
        self.clock = EngineClock(self.engine)
        # engine_build_s: the imports above and the engine's constructor
        self._startup = {"start_called_at": began, "engine_build_s": time.time() - began,
                         "engine_ready_at": time.time()}
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        r = self.cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        self._stop_ids = _end_ids(self.tokenizer)
        app = create_app(self.clock, self.tokenizer, api_token=self.api_token, model_name=MODEL_NAME,
                         sampling_defaults=lambda: self.sampling, recorder=self.recorder,
                         max_tokens_cap=r.max_new_tokens,
                         max_model_len=r.max_model_len,
                         seed_for_session=lambda sid, turn: session_seed(self.cfg.seed, sid, turn))
        self.server = ProxyServer(app)
        url = await self.server.start()
        import ray

        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        gpu_ids = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
        workers = []  # vLLM: each worker's GPU uuid and node (its own process, or a Ray actor of its own)
        device_bytes = engine_bytes = None  # vLLM: the GPU's memory and vLLM's share of it, with its CUDA context
        if self._engine_kind == "vllm":  # (the driver's `rollout.keep_awake = auto` check)
            from rlsys.engines.vllm_engine import device_total_bytes
            from rlsys.memory import CONTEXT_BYTES

            workers = [{**w, "node_id": w.get("node_id") or node_id} for w in await self.engine.worker_devices()]
            device_bytes = device_total_bytes()
            engine_bytes = int(self.engine.memory_fraction * device_bytes) + CONTEXT_BYTES
        # "on_gpu": the engine's weights live on a GPU (vLLM); with "node_id" and Ray's "gpu_ids" (or, for
        # vLLM's Ray executor, "workers") the driver plans the weight route (rlsys/weights/routes.py) and calls
        # `set_route`
        return {"url": url, "token": self.api_token, "model": MODEL_NAME, "transport": self.transport.name,
                "node_id": node_id, "gpu_ids": gpu_ids, "on_gpu": self._engine_kind == "vllm", "workers": workers,
                "ray_executor": self._engine_kind == "vllm" and self.cfg.ray_executor,
                "device_bytes": device_bytes, "engine_bytes": engine_bytes}

    async def node_id(self) -> str | None:
        """This actor's Ray node (answers before `start`, which blocks the actor's loop while the engine builds)."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    async def set_route(self, route: Any) -> None:
        """How weights arrive from now on: the driver's `EngineRoute` for this engine (rlsys/weights/routes.py),
        given once at job start; the engine receives by the route's transport (a collective route's group, as its
        rank there) until the actor ends."""
        self.route = route
        self.transport = make_transport(route.transport, route.group, route.group_rank)

    async def set_temperature(self, temperature: float | None) -> None:
        """Sampling temperature of requests that name none (evaluation is greedy); None = the config's."""
        value = self.cfg.rollout.temperature if temperature is None else temperature
        self.sampling = dataclasses.replace(self.sampling, temperature=value)

    async def pop_session(self, session_id: str, attempt: str | None = None) -> SessionRecord:
        return self.recorder.pop(session_id, attempt)

    async def pop_sessions(self, sessions: list[tuple[str, str | None]]) -> list[SessionRecord]:
        """``pop_session`` of each (session id, attempt): an env worker's episodes of one call, popped at once."""
        return [self.recorder.pop(session_id, attempt) for session_id, attempt in sessions]

    async def sleep(self, level: int) -> dict[str, float]:
        """Sleep the engine (level 0: stay awake, `rollout.keep_awake`); returns what it did since the last
        sleep (generation seconds, tokens) and, on a GPU, the device's memory in use right before (the rollout
        phase's footprint) and after sleeping."""
        from rlsys.memory import GIB, device_used_bytes_nvml

        stats = self.clock.pop_counters()
        gpu = self._engine_kind == "vllm"
        before = device_used_bytes_nvml() if gpu else None
        if level:
            await self.engine.sleep(level)
        after = device_used_bytes_nvml() if gpu else None
        if before is not None and after is not None:
            stats.update({"mem/rollout_device_used_gib": before / GIB, "mem/asleep_device_used_gib": after / GIB})
        return stats

    async def startup_times(self) -> dict[str, float | None]:
        """How long building the engine took, and when (time.time()) it was ready and first returned a sample."""
        return {**self._startup, "first_sample_at": self.clock.first_sample_at}

    async def bench_generate(self, prompts: list[list[int]], n: int) -> dict[str, float]:
        """`jobs.bench proxy` (a): every prompt ``n`` times straight into the engine, all at once, with the
        proxy's sampling settings and stop ids; tokens and wall seconds. The same engine serves (b)."""
        import asyncio

        stop = tuple(sorted(self._stop_ids))
        params = dataclasses.replace(self.sampling, stop_token_ids=stop)
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[self.engine.generate(p, params) for p in prompts for _ in range(n)])
        wall = time.perf_counter() - t0
        return {"tokens": float(sum(len(o.token_ids) for o in outs)), "wall_s": wall, "requests": float(len(outs))}

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.engine.wake(tags)
        if tags is None or "kv_cache" in tags:
            await self.engine.reset_prefix_cache()

    async def load_weights(self, *payloads: Any) -> int:
        """Load the payloads of the learner ranks that feed this engine (`EngineRoute.ranks`, in that order: one,
        but the CUDA IPC payload of each worker's rank for vLLM Ray workers on several GPUs, `PerGpuPayload`) in
        place by this engine's transport; returns the number of tensors loaded."""
        payload = payloads[0]
        if self.route is not None and self.route.per_gpu:
            from rlsys.weights.transport import PerGpuPayload

            payload = PerGpuPayload({uuid: p for (_, uuid), p in zip(self.route.per_gpu, payloads, strict=True)})
        return await self.engine.load_payload(self.transport, payload)

    async def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        return await self.engine.score(prompt_ids, continuation_ids)

    async def expect(self, n: int) -> None:
        """The next ``n`` generate requests are one wave (`Engine.expect`): the rollout phase's episodes."""
        self.engine.expect(n)

    async def weights_fingerprint(self) -> dict[str, int] | None:
        """What the last push wrote, as exact bit sums by tensor name (`Engine.weights_fingerprint`)."""
        return await self.engine.weights_fingerprint()

    async def named_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights as CPU copies (vLLM: under vLLM's names, q/k/v and gate/up fused)."""
        fetch = getattr(self.engine, "fetch_weights", None)
        if fetch is not None:
            return await fetch()
        return {n: t.detach().cpu().clone() for n, t in self.engine.named_weights()}

    async def stats(self) -> dict[str, Any]:
        return {"sessions": self.recorder.stats, "pid": os.getpid()}

    async def shutdown(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.engine is not None:
            await self.engine.shutdown()


def _end_ids(tokenizer: Any) -> set[int]:
    """The ids the proxy stops at (its `_ChatCodec.end_ids`): <|im_end|>, <|endoftext|> and the tokenizer's eos."""
    from rlsys.proxy.server import END_OF_TURN_TOKENS

    vocab = tokenizer.get_vocab()
    ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
    eos = tokenizer.eos_token_id
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids
