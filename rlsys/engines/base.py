"""The generation-engine interface that the proxy and the rollout actor program against.

Two implementations: ``TransformersEngine`` (CPU and GPU, batches concurrent requests itself) and the
vLLM engine (GPU, ``AsyncLLM``). Everything is token ids in, token ids + logprobs out: chat templates and
tool-call parsing belong to the proxy, so the learner trains on exactly what was sampled.

Logprobs are those of the model's raw distribution (temperature 1, no top-p), the same quantity the
learner recomputes, whatever temperature was used for sampling (vLLM's ``logprobs_mode=raw_logprobs``).
"""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


WAKE_TAGS = ("weights", "kv_cache")  # what `sleep` frees and `wake` brings back, in the order vLLM needs them
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS): 1/T overflows float32


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request seed: same seed + same weights -> same tokens
    stop_token_ids: tuple[int, ...] = ()  # generation also stops at the tokenizer's eos ids
    # Stop strings (OpenAI ``stop``): generation ends with the token whose text completes one of them. That
    # token stays in ``token_ids`` (it was sampled); the proxy cuts the message text before the string.
    stop: tuple[str, ...] = ()
    # OpenAI's penalties, on the logits before temperature/top-p: logit[t] -= frequency_penalty * count(t)
    # + presence_penalty * (count(t) > 0), count over the tokens generated so far (not the prompt), then
    # logit[t] += logit_bias[t]. The logprobs returned stay those of the raw distribution.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids sorted

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # also NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)


@dataclass
class GenerateOutput:
    token_ids: list[int]  # (C,) sampled ids, the stop token included when one ended generation
    logprobs: list[float]  # (C,) raw-distribution logprob of each sampled id
    finish_reason: str = "stop"  # "stop" (eos/stop id/stop string) | "length" (max_new_tokens reached)
    extra: dict = field(default_factory=dict)


def checked_token_ids(ids: list[int], vocab_size: int, what: str) -> list[int]:
    """``ids`` as ints, or ValueError naming the ids outside [0, vocab_size): a bad request fails alone
    instead of poisoning the batch it would join."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"{what}: ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def checked_prompt(prompt_ids: list[int], vocab_size: int, max_new_tokens: int, max_model_len: int | None,
                   limit: str) -> list[int]:
    """A generate request's prompt as ints, or ValueError: ids outside the vocabulary, an empty prompt, or a prompt
    that leaves no room for ``max_new_tokens`` within ``max_model_len`` (None: no limit; ``limit`` names it in the
    error, e.g. "the engine's max_model_len")."""
    prompt = checked_token_ids(prompt_ids, vocab_size, "prompt_ids")
    if not prompt:
        raise ValueError("prompt_ids is empty")
    total = len(prompt) + max_new_tokens
    if max_model_len is not None and total > max_model_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                         f"exceeds {limit} ({max_model_len})")
    return prompt


class Engine(ABC):
    """Async generation over token ids, with the weight and memory controls RL needs."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Sample a continuation of ``prompt_ids``. Concurrent calls are batched by the engine."""

    @abstractmethod
    async def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        """Raw logprobs (C,) of ``continuation_ids`` given ``prompt_ids`` under the current weights."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy weights in place by Hugging Face parameter name; returns how many tensors were loaded."""

    async def load_payload(self, transport: Any, payload: Any) -> int:
        """Load weights that arrived through ``transport`` (rlsys.weights.transport); returns the count.

        Engines whose weights live in another process (vLLM's engine core) override this to forward the
        payload (e.g. CUDA IPC handles) to that process instead of materialising tensors here."""
        return await asyncio.to_thread(self.load_weights, transport.receive(payload))

    async def set_lora(self, scale: float) -> None:
        """Serve the base plus a LoRA adapter from now on: pushes carry only `<module>.lora_A` / `.lora_B`
        tensors, merged into the weights as W_base + ``scale`` B A (rlsys/lora.py `LoraMerge`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve LoRA adapters")

    def expect(self, n: int) -> None:
        """A hint: the next ``n`` generate requests are one wave, sent together (a rollout phase's episodes). An
        engine that batches by arrival (the CPU engine) can wait for all of them instead of starting on the first
        few; engines that batch continuously (vLLM) ignore it."""

    async def weights_fingerprint(self) -> dict[str, int] | None:
        """{pushed tensor name: exact sum of its bits} over what the last push wrote (rlsys/weights/fingerprint.py),
        compared with the learner's after every push (`WeightSync.check_canary`); None when this engine cannot tell,
        and the logprob canary then checks that push."""
        return None

    async def sleep(self, level: int = 1) -> None:
        """Free memory between rollouts: level 1 keeps weights (offloaded), level 2 drops them."""

    async def wake(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep``; ``tags`` may wake "weights" before "kv_cache" so weights can be pushed first."""

    async def reset_prefix_cache(self) -> None:
        """Drop cached prefixes computed with old weights."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's current weights by HF name (for tests and the weight-equality check)."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop background work; the engine is unusable afterwards."""

    # --- state the engines keep alike (`_closed`, `_weights_dropped`, `vocab_size`: each engine sets them) ---------
    @property
    def weights_dropped(self) -> bool:
        """True after `sleep(2)` until a push refilled every parameter: serving before that would be garbage."""
        return self._weights_dropped

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def _checked_ids(self, ids: list[int], what: str) -> list[int]:
        return checked_token_ids(ids, self.vocab_size, what)

    def _checked_wake_tags(self, tags: list[str] | None) -> list[str]:
        """`wake`'s tags (None: all of `WAKE_TAGS`), each one known (ValueError otherwise), on an open engine."""
        self._check_open()
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"unknown wake tags {unknown}; expected a subset of {list(WAKE_TAGS)}")
        return tags

    def _checked_score_ids(self, prompt_ids: list[int], continuation_ids: list[int]) -> tuple[list[int], list[int]]:
        """A `score` request's ids: every id in the vocabulary and the prompt not empty (ValueError otherwise)."""
        prompt = self._checked_ids(prompt_ids, "prompt_ids")
        continuation = self._checked_ids(continuation_ids, "continuation_ids")
        if not prompt:
            raise ValueError("prompt_ids is empty")
        return prompt, continuation
