"""A generation engine on plain transformers: the CPU path of rlsys (and a GPU fallback without vLLM).

On CPU, generation runs rlsys/engines/cpu_decode.py's hand-written loop over the model's own weights when the model
allows it (Qwen2/Llama architecture, float32, full attention: ``fast_decode``), several times faster than the
transformers loop below for small models, with the same tokens and logprobs up to float rounding
(tests/unit/test_cpu_decode.py). Everything else here (batching, sampling semantics, stop rules) holds for both loops.

Concurrent ``generate``/``score`` calls are queued; one background asyncio task takes up to
``max_batch_size`` of them and runs the batch in a single worker thread, so the event loop, which also
serves the HTTP proxy, stays responsive while torch computes. A batch starts when it is full, or when
``batch_wait_s`` has passed without a new request (at most ``batch_wait_max_s`` after its first one):
the agents' requests of a rollout arrive over a few hundred ms on CPU, with gaps of tens of ms, and a
batch that started on the first of them decoded alone while the rest queued behind it (two or three
batches a step instead of one; docs/results-cpu.md). The rollout phase says how many requests it sends
(``expect(n)``): until that many came, a batch waits for them (at most ``expect_wait_max_s`` after its first)
whatever the gaps, since on 2 cores the late ones are late because the batch before them took the CPU.
Batched decoding left-pads the prompts (attention mask + per-row position ids), keeps a KV cache
(``DynamicCache``) and drops rows from the batch as they finish. Requests of a batch with the same prompt ids
(the n samples of a group) prefill it once and copy its KV cache rows (``share_prefill``); each keeps its own
generator, so its samples are the ones an unshared prefill gives (up to the numerics of the smaller prefill batch).

Sampling is per request: temperature (0, or below ``GREEDY_BELOW``, = greedy), top-p, OpenAI's frequency and
presence penalties and logit bias (applied to the logits first, as vLLM does), and a ``torch.Generator`` seeded from
``SamplingParams.seed`` (or from an engine-level generator seeded at construction). Each sampled
token consumes exactly one uniform from the request's own generator, so the random stream does not
depend on which other requests share the batch; the logits can still differ in the last bits with
the batch's padding and shape, so a seeded token is reproducible across batch compositions only "as
far as numerics allow" (a flip needs the uniform to land within ~1e-7 of a CDF boundary).

Stop strings: after each token of a request that has them, the tail of its decoded text (enough tokens to hold
the longest stop string, byte tokens included) is searched; the token that completes a stop string ends the
request and stays in its ``token_ids``. The tokenizer is loaded from ``model_path`` the first time it is needed.

Logprobs are those of the raw distribution (log_softmax at temperature 1, no top-p) at the sampled
token: the quantity the learner recomputes (vLLM's ``logprobs_mode=raw_logprobs``).

``sleep(level=2)`` mirrors vLLM: weights count as dropped until ``load_weights`` has refilled every
parameter, and generating before that raises instead of serving stale weights (vLLM #29341; docs/gpu.md,
"What rlsys relies on"). Token ids are validated before they reach a batch, so one bad request never fails others.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rlsys.engines.base import WAKE_TAGS, Engine, GenerateOutput, SamplingParams, checked_prompt
from rlsys.engines.hf_loop import StopText, adjusted_logits, growing_cache, sample_rows
from rlsys.heap import keep_freed_memory

log = logging.getLogger(__name__)

WEIGHTS_DROPPED = "weights dropped by sleep(level=2); load_weights() before wake"
# score() splits its batch so that the (B, C+1, V) fp32 logits stay under this many bytes
SCORE_LOGITS_BUDGET_BYTES = 256 * 1024 * 1024


@dataclass
class _GenerateRequest:
    prompt_ids: list[int]  # (P,)
    params: SamplingParams
    generator: torch.Generator  # CPU generator, one uniform per sampled token
    future: asyncio.Future


@dataclass
class _ScoreRequest:
    prompt_ids: list[int]  # (P,)
    continuation_ids: list[int]  # (C,)
    future: asyncio.Future


def _as_id_list(eos: int | Iterable[int] | None) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos]


class TransformersEngine(Engine):
    """``Engine`` over ``AutoModelForCausalLM``, batching concurrent requests itself."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.05,
        batch_wait_max_s: float = 0.5,
        expect_wait_max_s: float = 1.0,
        share_prefill: bool = True,
        num_threads: int | None = None,
        eos_token_ids: int | Iterable[int] | None = None,
        seed: int = 0,
        attn_implementation: str | None = None,
        fast_decode: bool | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy import, only when built)

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # each batch's caches and scores reuse the last batch's pages (rlsys/heap.py)
        if batch_wait_max_s < batch_wait_s:
            raise ValueError(f"batch_wait_max_s ({batch_wait_max_s}) must be >= batch_wait_s ({batch_wait_s})")
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s  # a batch starts after this long without a new request...
        self.batch_wait_max_s = batch_wait_max_s  # ...or this long after its first request
        self.expect_wait_max_s = expect_wait_max_s  # a wave announced by expect(): its batch waits this long at most
        self._expected = 0  # generate requests of the announced wave not yet taken into a batch
        self.share_prefill = share_prefill
        load_kwargs = {"dtype": dtype}
        if attn_implementation is not None:
            load_kwargs["attn_implementation"] = attn_implementation
        self.model_path = model_path
        self._tokenizer = None  # loaded on the first request with stop strings
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **load_kwargs).to(self.device).eval()
        self.model.requires_grad_(False)
        config = self.model.config

        # ---- ids the engine needs: vocab bound, eos, pad, context length
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        text_config = config.get_text_config()
        if eos_token_ids is None:
            gen_cfg = getattr(self.model, "generation_config", None)
            eos_token_ids = getattr(gen_cfg, "eos_token_id", None)
            if eos_token_ids is None:
                eos_token_ids = getattr(text_config, "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = tuple(_as_id_list(eos_token_ids))
        pad = getattr(text_config, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.max_model_len: int | None = getattr(text_config, "max_position_embeddings", None)
        # transformers 5.x renamed past_key_values -> cache (the old name is deprecated until 5.40)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

        # ---- weight targets by HF name; tied weights appear under every alias
        self._targets: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        for name, p in self.model.named_parameters(remove_duplicate=False):
            self._targets.setdefault(name, p)  # e.g. lm_head.weight when a version leaves it out
        self._param_ids = {id(p) for p in self.model.parameters()}  # unique parameters (aliases once)

        # ---- decode loop: rlsys/engines/cpu_decode.py where the model allows (default on CPU), else transformers'
        from rlsys.engines.cpu_decode import unsupported_reason  # noqa: PLC0415

        reason = unsupported_reason(self.model)
        if fast_decode and reason is not None:
            raise ValueError(f"fast_decode=True but the model cannot use it: {reason}")
        self.fast_decode = reason is None and (fast_decode or (fast_decode is None and self.device.type == "cpu"))
        self._fast_decoder = None  # built on the first batch, dropped by load_weights (it holds fused copies)
        self._lora = None  # a rlsys.lora.LoraMerge after `set_lora`: pushes are adapters merged into the weights

        # ---- state
        self._seed_generator = torch.Generator().manual_seed(seed)  # seeds for seed=None requests
        self._sleeping: set[str] = set()  # subset of WAKE_TAGS
        self._weights_dropped = False
        self._loaded_since_drop: set[int] = set()  # ids of parameters refilled after sleep(2)
        self._closed = False
        # one worker thread runs every forward pass; load_weights takes the same lock. Its torch threads are set
        # in that thread (OpenMP's count is per thread; a new thread starts from the creating thread's)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rlsys-engine",
            initializer=torch.set_num_threads if num_threads else None, initargs=(num_threads,) if num_threads else ())
        self._model_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ public API

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self._check_serving()
        prompt = checked_prompt(prompt_ids, self.vocab_size, params.max_new_tokens, self.max_model_len,
                                "the model's max_position_embeddings")
        if params.stop:
            self._stop_tokenizer()  # here, once: a model without a tokenizer fails this request, not its batch
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_generator))
        generator = torch.Generator().manual_seed(seed)
        return await self._submit(lambda fut: _GenerateRequest(prompt, params, generator, fut))

    async def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        self._check_serving()
        prompt, continuation = self._checked_score_ids(prompt_ids, continuation_ids)
        total = len(prompt) + len(continuation)
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"{total} tokens exceed the model's max_position_embeddings ({self.max_model_len})")
        if not continuation:
            return []
        return await self._submit(lambda fut: _ScoreRequest(prompt, continuation, fut))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors in place by HF name (dtype cast allowed, shape must match); returns the count.

        Blocks while a batch is running (the worker holds the same lock).
        """
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._lora is not None:
            with self._model_lock:
                count = self._lora.apply(named_tensors)
                self._fast_decoder = None
            return count
        count = 0
        with self._model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                target = self._targets.get(name)
                if target is None:
                    raise KeyError(f"load_weights: unknown weight name {name!r} (the model has {len(self._targets)})")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor)  # in place: casts dtype and moves device
                self._loaded_since_drop.add(id(target))
                count += 1
            self._fast_decoder = None
            if self._weights_dropped and self._param_ids <= self._loaded_since_drop:
                self._weights_dropped = False
        return count

    async def weights_fingerprint(self) -> dict[str, int] | None:
        """The parameters' bit sums by HF name (with LoRA: the adapters last merged); None while dropped weights
        wait for a push (the canary then reports them)."""
        from rlsys.weights.fingerprint import tensor_sums  # noqa: PLC0415

        if self._weights_dropped:
            return None
        if self._lora is not None:
            return self._lora.last_sums
        with self._model_lock:
            return tensor_sums(self._targets.items())

    async def set_lora(self, scale: float) -> None:
        """From now on `load_weights` takes LoRA adapters and merges them into the HF weights they name."""
        from rlsys.lora import LoraMerge  # noqa: PLC0415

        def resolve(module: str) -> tuple[torch.Tensor, torch.Tensor]:
            target = self._targets.get(f"{module}.weight")
            if target is None:
                raise KeyError(f"LoRA push: the model has no weight {module}.weight")
            return target.data, target

        self._lora = LoraMerge(scale, resolve)

    async def sleep(self, level: int = 1) -> None:
        """Level 1: nothing to free on CPU, only recorded. Level 2: weights count as dropped."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._check_open()
        self._sleeping = set(WAKE_TAGS)
        if level == 2:
            self._weights_dropped = True
            self._loaded_since_drop.clear()

    async def wake(self, tags: list[str] | None = None) -> None:
        tags = self._checked_wake_tags(tags)
        self._sleeping.difference_update(tags)

    async def reset_prefix_cache(self) -> None:
        self._check_open()  # no prefix cache here: every batch starts from an empty KV cache

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    async def shutdown(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._queue is not None:
            while not self._queue.empty():
                req = self._queue.get_nowait()
                if not req.future.done():
                    req.future.set_exception(RuntimeError("engine shut down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping)

    # ------------------------------------------------------------------ state checks

    def _check_serving(self) -> None:
        self._check_open()
        if self._weights_dropped:
            n = len(self._loaded_since_drop & self._param_ids)
            raise RuntimeError(f"{WEIGHTS_DROPPED} ({n}/{len(self._param_ids)} parameters loaded since)")
        if self._sleeping:
            raise RuntimeError(f"engine is asleep ({sorted(self._sleeping)}); call wake() first")

    # ------------------------------------------------------------------ batching (event loop side)

    async def _submit(self, make_request) -> object:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            if self._loop is not None and self._loop is not loop and self._loop.is_running():
                raise RuntimeError("TransformersEngine is serving another running event loop")
            # first call, or a new loop (e.g. a second asyncio.run): the old task died with its loop
            self._loop, self._queue = loop, asyncio.Queue()
            self._task = loop.create_task(self._batch_loop(self._queue), name="rlsys-engine-batcher")
        future = loop.create_future()
        self._queue.put_nowait(make_request(future))
        return await future

    async def _batch_loop(self, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            if isinstance(batch[0], _GenerateRequest):  # a score (the canary) runs at once: no wave to wait for
                await self._wait_for_company(queue)
            while len(batch) < self.max_batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            self._expected = max(0, self._expected - sum(isinstance(r, _GenerateRequest) for r in batch))
            batch = [r for r in batch if not r.future.done()]  # callers that gave up
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, batch)
            except asyncio.CancelledError:
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(RuntimeError("engine shut down"))
                raise
            except Exception as exc:  # the batch's callers get the error; the engine keeps serving
                log.warning("engine batch of %d failed: %r", len(batch), exc)
                results = [exc] * len(batch)
            for req, res in zip(batch, results):
                if req.future.done():
                    continue
                if isinstance(res, BaseException):
                    req.future.set_exception(res)
                else:
                    req.future.set_result(res)

    def expect(self, n: int) -> None:
        """The next ``n`` generate requests are one wave (`Engine.expect`): batch them together."""
        if n < 0:
            raise ValueError(f"expect: n must be >= 0, got {n}")
        self._expected = int(n)

    async def _wait_for_company(self, queue: asyncio.Queue) -> None:
        """Return once the batch (one generate request already taken) is full, or no request came for
        ``batch_wait_s``, or ``batch_wait_max_s`` passed. While an announced wave (`expect`) is still arriving:
        once all of it is queued (or the batch is full), or ``expect_wait_max_s`` passed (the wave's rest is
        given up on: some of its episodes sent nothing). A batch led by a score request does not wait: the canary
        scored while a wave was announced and never came (an SFT step, whose episodes do not generate) waited
        ``expect_wait_max_s``, 1 s of every ~2 s step of the CPU recipe's SFT stage."""
        loop = asyncio.get_running_loop()
        if self._expected > 0:
            want = min(self._expected, self.max_batch_size) - 1  # the batch already holds one request
            deadline = loop.time() + self.expect_wait_max_s
            while queue.qsize() < want:
                if loop.time() >= deadline:
                    self._expected = 0
                    return
                await asyncio.sleep(0.002)
            return
        if self.batch_wait_s <= 0:
            return
        deadline = loop.time() + self.batch_wait_max_s
        seen = -1
        while queue.qsize() < self.max_batch_size - 1 and queue.qsize() != seen:
            seen = queue.qsize()
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(self.batch_wait_s, left))

    # ------------------------------------------------------------------ compute (worker thread side)

    def _run_batch(self, batch: list) -> list:
        """Results (or the exception of their sub-batch) in the order of ``batch``."""
        generate = [r for r in batch if isinstance(r, _GenerateRequest)]
        score = [r for r in batch if isinstance(r, _ScoreRequest)]
        results: dict[int, object] = {}
        with self._model_lock, torch.inference_mode():
            for reqs, run in ((generate, self._generate_batch), (score, self._score_batch)):
                if not reqs:
                    continue
                try:
                    self._check_serving()  # sleep() may have come between enqueue and now
                    outs = run(reqs)
                except Exception as exc:
                    log.warning("engine %s batch of %d failed: %r", run.__name__, len(reqs), exc)
                    outs = [exc] * len(reqs)
                results.update((id(r), o) for r, o in zip(reqs, outs))
        return [results[id(r)] for r in batch]

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, L) input ids, attention mask and position ids; real tokens flush right."""
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attention_mask[i, width - len(s) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # 0.. on real tokens, 0 on pads
        return input_ids.to(self.device), attention_mask.to(self.device), position_ids.to(self.device)

    def _forward(self, input_ids, attention_mask, position_ids, cache=None, logits_to_keep: int = 0) -> torch.Tensor:
        kwargs = {self._cache_kwarg: cache, "use_cache": cache is not None}
        out = self.model(
            input_ids=input_ids,  # (B, T)
            attention_mask=attention_mask,  # (B, past + T)
            position_ids=position_ids,  # (B, T)
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return out.logits  # (B, T or logits_to_keep, V)

    def _generate_batch(self, reqs: list[_GenerateRequest]) -> list[GenerateOutput]:
        if not self.fast_decode:
            return self._generate_batch_transformers(reqs)
        from rlsys.engines.cpu_decode import FastDecoder  # noqa: PLC0415

        if self._fast_decoder is None:
            self._fast_decoder = FastDecoder(self.model)
        return self._fast_decoder.generate(
            [r.prompt_ids for r in reqs], [r.params for r in reqs], [r.generator for r in reqs],
            stops=[set(self.eos_token_ids) | set(r.params.stop_token_ids) for r in reqs],
            stop_text=[StopText(self._stop_tokenizer(), r.params.stop) if r.params.stop else None for r in reqs],
            pad_token_id=self.pad_token_id, share_prefill=self.share_prefill)

    def _generate_batch_transformers(self, reqs: list[_GenerateRequest]) -> list[GenerateOutput]:
        """The generic loop: transformers' forward with a growing KV cache, rows dropped as they finish."""
        n = len(reqs)
        stops = [set(self.eos_token_ids) | set(r.params.stop_token_ids) for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[float]] = [[] for _ in reqs]
        finish: list[str] = ["length"] * n

        logits, cache, attention_mask = self._prefill([r.prompt_ids for r in reqs],
                                                      max(r.params.max_new_tokens for r in reqs))  # (n, V), (n, L)
        active = list(range(n))  # request index of each batch row
        next_pos = torch.tensor([len(r.prompt_ids) for r in reqs], device=self.device)  # (b,)

        stop_text = [StopText(self._stop_tokenizer(), r.params.stop) if r.params.stop else None for r in reqs]
        counts = [torch.zeros(self.vocab_size, device=self.device) if r.params.adjusts_logits else None
                  for r in reqs]  # (V,) times each token was generated, for the penalties

        # ---- decode: sample, record, drop finished rows, feed the sampled tokens
        while True:
            raw = torch.log_softmax(logits.float(), dim=-1)  # (b, V) raw distribution, T = 1
            params = [reqs[i].params for i in active]
            sampled_t = sample_rows(adjusted_logits(logits, params, [counts[i] for i in active]), params,
                                          [reqs[i].generator for i in active])
            sampled = sampled_t.tolist()
            sampled_logprobs = raw.gather(1, sampled_t.unsqueeze(1)).squeeze(1).tolist()  # (b,)
            keep = []
            for row, i in enumerate(active):
                tok = sampled[row]
                tokens[i].append(tok)
                logprobs[i].append(sampled_logprobs[row])
                if counts[i] is not None:
                    counts[i][tok] += 1
                if tok in stops[i] or (stop_text[i] is not None and stop_text[i].completed(tokens[i])):
                    finish[i] = "stop"
                elif len(tokens[i]) < reqs[i].params.max_new_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                rows = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(rows)
                attention_mask, next_pos = attention_mask[rows], next_pos[rows]
                active, sampled = [active[r] for r in keep], [sampled[r] for r in keep]
            b = len(active)
            attention_mask = torch.cat(
                [attention_mask, torch.ones((b, 1), dtype=attention_mask.dtype, device=self.device)], dim=1
            )  # (b, past + 1)
            step_ids = torch.tensor(sampled, device=self.device).unsqueeze(1)  # (b, 1)
            logits = self._forward(step_ids, attention_mask, next_pos.unsqueeze(1), cache)[:, -1]  # (b, V)
            next_pos = next_pos + 1
        return [
            GenerateOutput(token_ids=tokens[i], logprobs=logprobs[i], finish_reason=finish[i]) for i in range(n)
        ]

    def _stop_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # noqa: PLC0415

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def _prefill(self, prompts: list[list[int]], max_new_tokens: int):
        """Last-position logits (n, V), the KV cache and the (n, L) attention mask of ``prompts``.

        With ``share_prefill``, each distinct prompt runs once and its cache rows are copied to every
        request that sent it: the n samples of a group cost one prompt's prefill, not n.
        """
        if self.share_prefill:
            first_of: dict[tuple[int, ...], int] = {}
            row_of = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]  # (n,) distinct-prompt row
            distinct = [list(p) for p in first_of]
        else:
            row_of, distinct = list(range(len(prompts))), prompts
        input_ids, attention_mask, position_ids = self._left_pad(distinct)
        cache = growing_cache(self.model.config, input_ids.shape[1] + max_new_tokens)
        logits = self._forward(input_ids, attention_mask, position_ids, cache, logits_to_keep=1)[:, -1]  # (u, V)
        if len(distinct) < len(prompts):
            rows = torch.tensor(row_of, device=self.device)  # (n,)
            cache.batch_select_indices(rows)  # copies the repeated rows: each request's cache is its own
            logits, attention_mask = logits[rows], attention_mask[rows]
        return logits, cache, attention_mask

    def _score_batch(self, reqs: list[_ScoreRequest]) -> list[list[float]]:
        out: list[list[float]] = []
        vocab = self.vocab_size
        start = 0
        while start < len(reqs):  # sub-batches that keep the logits under the budget
            end, longest = start, 0
            while end < len(reqs):
                longest_if = max(longest, len(reqs[end].continuation_ids))
                if end > start and (end - start + 1) * (longest_if + 1) * vocab * 4 > SCORE_LOGITS_BUDGET_BYTES:
                    break
                longest, end = longest_if, end + 1
            out.extend(self._score_padded(reqs[start:end], longest))
            start = end
        return out

    def _score_padded(self, reqs: list[_ScoreRequest], longest: int) -> list[list[float]]:
        # left padding makes every sequence end at the last column, so the logits that predict any
        # continuation sit in the last (longest + 1) positions
        input_ids, attention_mask, position_ids = self._left_pad([r.prompt_ids + r.continuation_ids for r in reqs])
        logits = self._forward(input_ids, attention_mask, position_ids, logits_to_keep=longest + 1)  # (B, K, V)
        raw = torch.log_softmax(logits.float(), dim=-1)  # (B, K, V)
        k = longest + 1
        result = []
        for i, r in enumerate(reqs):
            c = len(r.continuation_ids)
            rows = torch.arange(k - 1 - c, k - 1, device=self.device)  # logits at t predict token t + 1
            cont = torch.tensor(r.continuation_ids, device=self.device)
            result.append(raw[i, rows, cont].tolist())
        return result
