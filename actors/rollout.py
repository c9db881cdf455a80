"""Rollout actor: one generation engine plus the OpenAI-compatible proxy that agents call.

An async Ray actor: the proxy's uvicorn server runs as a task of the actor's event loop, next to the
engine's batching loop, so agent HTTP traffic and Ray calls (pop a session, sleep, load weights) are
served by the same process without threads fighting over the model. Plain class, testable without Ray.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import secrets
from typing import Any

import torch

from rlsys.config import Config
from rlsys.engines import SamplingParams, make_engine
from rlsys.proxy.sessions import SessionRecord, SessionRecorder
from rlsys.weights.transport import make_transport

MODEL_NAME = "rlsys-policy"


def session_seed(base_seed: int, session_id: str, turn: int) -> int:
    """Per-turn sampling seed from the job seed and the (deterministic) session id: reruns and resumed
    runs sample the same tokens on CPU, whatever order the requests arrive in."""
    digest = hashlib.blake2b(f"{base_seed}/{session_id}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def resolve_engine_kind(cfg: Config) -> str:
    """`rollout.engine`, with `auto` = vLLM when this process sees CUDA and vLLM is installed."""
    kind = cfg.rollout.engine
    if kind == "auto":
        has_vllm = importlib.util.find_spec("vllm") is not None
        kind = "vllm" if has_vllm and torch.cuda.is_available() else "transformers"
    return kind


def engine_dtype(cfg: Config) -> str:
    """vLLM's dtype from `model.dtype` (`auto` = bfloat16 on the GPU, as the learner)."""
    return "bfloat16" if cfg.model.dtype == "auto" else cfg.model.dtype


def build_engine(cfg: Config, model_path: str):
    """The engine `rollout.engine` asks for; vLLM's memory share comes from `rollout.gpu_memory_budget_gib`."""
    r = cfg.rollout
    kind = resolve_engine_kind(cfg)
    if kind == "vllm":
        from rlsys.engines.vllm_engine import device_total_bytes, memory_fraction

        return make_engine("vllm", model_path, max_batch_size=r.engine_max_batch, seed=cfg.seed,
                           dtype=engine_dtype(cfg),
                           gpu_memory_utilization=memory_fraction(r.gpu_memory_budget_gib, device_total_bytes()),
                           max_model_len=r.max_model_len, enforce_eager=r.enforce_eager, enable_sleep_mode=True)
    return make_engine(kind, model_path, max_batch_size=r.engine_max_batch, seed=cfg.seed)


class RolloutWorker:
    def __init__(self, cfg: Config, model_path: str, *, api_token: str | None = None,
                 num_threads: int | None = None, transport: str | None = None) -> None:
        """``transport``: how weights arrive. `auto` (or unset with `sync.transport = auto`) is resolved in
        `start`, where the engine is known: CUDA IPC for a vLLM engine (the placement puts it on its learner
        rank's GPU), the object store otherwise."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.cfg = cfg
        self.model_path = model_path
        self.api_token = api_token or secrets.token_urlsafe(24)
        self.recorder = SessionRecorder()
        self._transport_name = transport or cfg.sync.transport
        self.transport = None
        self.engine = None
        self.server = None

    async def start(self) -> dict[str, Any]:
        """Build the engine and start the proxy inside this event loop; returns how agents reach it."""
        from transformers import AutoTokenizer

        from rlsys.proxy.server import ProxyServer, create_app

        self.engine = build_engine(self.cfg, self.model_path)
        if self._transport_name == "auto":
            self._transport_name = "cuda_ipc" if resolve_engine_kind(self.cfg) == "vllm" else "object_store"
        self.transport = make_transport(self._transport_name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        r = self.cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        app = create_app(self.engine, self.tokenizer, api_token=self.api_token, model_name=MODEL_NAME,
                         sampling_defaults=lambda: self.sampling, recorder=self.recorder,
                         max_tokens_cap=r.max_new_tokens,
                         max_model_len=r.max_model_len,
                         seed_for_session=lambda sid, turn: session_seed(self.cfg.seed, sid, turn))
        self.server = ProxyServer(app)
        url = await self.server.start()
        import ray

        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"url": url, "token": self.api_token, "model": MODEL_NAME, "transport": self._transport_name,
                "node_id": node_id}

    async def set_temperature(self, temperature: float | None) -> None:
        """Sampling temperature of requests that name none (evaluation is greedy); None = the config's."""
        value = self.cfg.rollout.temperature if temperature is None else temperature
        self.sampling = dataclasses.replace(self.sampling, temperature=value)

    async def pop_session(self, session_id: str) -> SessionRecord:
        return self.recorder.pop(session_id)

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level)

    async def wake(self, tags: list[str] | None = None) -> None:
        await self.engine.wake(tags)
        if tags is None or "kv_cache" in tags:
            await self.engine.reset_prefix_cache()

    async def load_weights(self, payload: Any) -> int:
        """Load a transport payload in place; returns the number of tensors loaded."""
        return await self.engine.load_payload(self.transport, payload)

    async def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        return await self.engine.score(prompt_ids, continuation_ids)

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
