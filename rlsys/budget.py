"""A job's GPU memory against its budget and the device, from its config (rlsys/memory.py has the estimate itself):
the estimate of a config's job, the learner/engine split both sides compute alike, vLLM's fixed KV cache checked
against one sequence, the refusal of a job over its budget, and the search for settings that fit (`rlsys tune`).
Pure Python (no torch, no Ray), as the estimate."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from rlsys.memory import (GIB, LORA_KEPT, MAX_DEVICE_SHARE, SUGGEST_MARGIN, BudgetSplit, Estimate, JobShape,
                          MemoryBudgetError, ModelShape, estimate, read_model_config)


# ------------------------------------------------------------------ searching settings that fit
@dataclass(frozen=True)
class Proposal:
    job: JobShape
    estimate: Estimate
    changed: dict[str, Any]  # dotted config key -> new value

    def flags(self) -> list[str]:
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changed.items()]


def _divisors_desc(n: int) -> list[int]:
    return [k for k in range(n, 0, -1) if n % k == 0]


def _token_budgets_desc(job: JobShape) -> list[int]:
    """`learner.micro_batch_tokens` to try: the current one, then halved down to one sequence (`seq_len`)."""
    out, t = [job.micro_batch_tokens], job.micro_batch_tokens // 2
    while t >= job.seq_len:
        out.append(t)
        t //= 2
    if out[-1] > job.seq_len:
        out.append(job.seq_len)
    return out


def learner_cost(job: JobShape, per_minibatch: int) -> float:
    """`suggest`'s rough learner time per sequence: the arithmetic (1) plus a fixed cost per pass through the layers
    (measured: the learner's time is a count of passes, ~0.2 s each on an H100 whatever a micro-batch holds, and
    prefix sharing makes two a micro-batch: docs/performance.md, section 7), x1.3 under gradient checkpointing."""
    micro_batches = math.ceil(per_minibatch / job.micro_rows)
    passes = micro_batches * (2 if job.shares_prefixes else 1)
    return (1.3 if job.gradient_checkpointing else 1.0) * (1 + passes / per_minibatch)


def suggest(model: ModelShape, job: JobShape, budget_gib: float, *, per_minibatch: int | None = None,
            max_concurrency: int | None = None, allow_8bit: bool = True) -> Proposal | None:
    """The settings that fit ``budget_gib`` and look fastest, or None. Searched: gradient checkpointing, 8-bit Adam,
    the micro-batch (a divisor of ``per_minibatch``, default the current micro-batch; or, where the job sizes its
    micro-batches by `learner.micro_batch_tokens`, that budget halved down to one sequence) and the engine's
    concurrent sequences (up to ``max_concurrency``, default the current min(engine_max_batch, episodes per step)).
    "Fastest" is a rough cost model: `learner_cost` (passes through the layers; checkpointing ~30% more and no
    prefix sharing), c concurrent sequences 1 + 4/c of rollout time; 8-bit Adam is free. Ties go to the fewest
    changes. A proposal leaves SUGGEST_MARGIN of the budget unused."""
    current = min(job.engine_max_batch, job.concurrency)
    top = max_concurrency or current
    concurrency = [top] + [c for c in (256, 128, 64, 32, 16, 8, 4, 2, 1) if c < top]
    adam = [job.adam_8bit] + ([True] if allow_8bit and not job.adam_8bit else [])
    checkpointing = [job.gradient_checkpointing] + ([True] if not job.gradient_checkpointing else [])
    per = per_minibatch or job.micro_rows
    if job.micro_batch_tokens:
        micro = [{"micro_batch_tokens": t} for t in _token_budgets_desc(job)]
    else:
        micro = [{"mini_bs": b} for b in _divisors_desc(per_minibatch or job.mini_bs)]
    best: tuple[float, int, Proposal] | None = None
    for eight_bit in adam:
        for ckpt in checkpointing:
            for size in micro:
                for conc in concurrency:
                    engine_max = conc if conc != current else job.engine_max_batch
                    cand = replace(job, adam_8bit=eight_bit, gradient_checkpointing=ckpt, engine_max_batch=engine_max,
                                   **size)
                    est = estimate(model, cand, budget_gib)
                    if est.total_bytes > (1 - SUGGEST_MARGIN) * est.budget_bytes:
                        continue
                    cost = learner_cost(cand, per) + (1 + 4 / conc)
                    prop = Proposal(job=cand, estimate=est, changed=_changes(job, cand))
                    key = (round(cost, 6), len(prop.changed))
                    if best is None or key < best[:2]:
                        best = (*key, prop)
    return best[2] if best else None


def _changes(old: JobShape, new: JobShape) -> dict[str, Any]:
    keys = {"adam_8bit": "learner.adam_8bit", "gradient_checkpointing": "model.gradient_checkpointing",
            "mini_bs": "learner.mini_bs", "micro_batch_tokens": "learner.micro_batch_tokens",
            "engine_max_batch": "rollout.engine_max_batch",
            "max_model_len": "rollout.max_model_len"}
    return {dotted: getattr(new, k) for k, dotted in keys.items() if getattr(new, k) != getattr(old, k)}


# ------------------------------------------------------------------ the job's check and split
def job_estimate(cfg: Any, model_path: str | os.PathLike, prompt_tokens: int | None = None) -> Estimate:
    """The estimate of ``cfg``'s job with its budget (`rollout.gpu_memory_budget_gib`, None = no budget)."""
    shape = ModelShape.from_config(read_model_config(model_path))
    return estimate(shape, JobShape.from_config(cfg, prompt_tokens), cfg.rollout.gpu_memory_budget_gib)


def budget_split(cfg: Any, model_path: str | os.PathLike) -> BudgetSplit | None:
    """The learner/engine split of the job's budget (None without a budget). The learner and the rollout actor
    both call this with the same config and model, so they agree without talking to each other."""
    if cfg.rollout.gpu_memory_budget_gib is None:
        return None
    return job_estimate(cfg, model_path).split()


def fixed_kv_engine_bytes(cfg: Any, model_path: str | os.PathLike) -> int:
    """What vLLM holds under `rollout.kv_cache_gib` (and no budget): the estimate's engine (whose KV cache is that
    size), its CUDA context left out as in a budget's engine share (actors/rollout.py)."""
    engine = dict(job_estimate(cfg, model_path).engine)
    engine.pop("CUDA context", None)
    engine.pop(LORA_KEPT, None)  # beside vLLM's pool, not in its gpu_memory_utilization
    return sum(engine.values())


KV_BLOCK_TOKENS = 16  # vLLM's KV cache block on CUDA (cache_config.block_size): a sequence takes whole blocks


def one_sequence_kv_bytes(model: ModelShape, max_model_len: int, dtype_bytes: int = 2, tp_size: int = 1) -> int:
    """The least KV cache for vLLM on one GPU: one sequence of ``max_model_len`` tokens in whole blocks (less, and
    vLLM 0.26's `check_enough_kv_cache_memory` refuses to start), plus the null block its block pool takes out of
    the cache first (`BlockPool.null_block`; without it such a sequence would not fit the pool)."""
    blocks = -(-max_model_len // KV_BLOCK_TOKENS) + 1
    return blocks * KV_BLOCK_TOKENS * model.kv_bytes_per_token(dtype_bytes, tp_size)


def kv_cache_refusal(model: ModelShape, job: JobShape, tp_size: int = 1) -> str | None:
    """Why vLLM would refuse `rollout.kv_cache_gib` (``job.kv_cache_bytes``), with the fix, or None: the size is
    unset (vLLM sizes it), holds one `max_model_len` sequence, or the model has sliding-window layers (they need
    less than full attention's count, which would refuse sizes vLLM accepts). vLLM finds out only in its engine's
    start, after Ray and the actors are up."""
    if job.kv_cache_bytes is None or not model.full_attention:
        return None
    need = one_sequence_kv_bytes(model, job.max_model_len, job.dtype_bytes, tp_size)
    if job.kv_cache_bytes >= need:
        return None
    per_token = model.kv_bytes_per_token(job.dtype_bytes, tp_size)
    at_least = math.ceil(need * 100 / GIB) / 100  # GiB, rounded up to what a config states
    if int(at_least * GIB) < need:  # float rounding, as `JobShape.from_config` converts it
        at_least += 0.01
    longest = (job.kv_cache_bytes // (KV_BLOCK_TOKENS * per_token) - 1) * KV_BLOCK_TOKENS
    shorter = f" or lower rollout.max_model_len to at most {longest}" if longest >= 16 else ""  # the config's least
    gpu = f" on each of {tp_size} GPUs" if tp_size > 1 else ""
    return (f"rollout.kv_cache_gib: {job.kv_cache_bytes / GIB:g} GiB of KV cache is less than one sequence of "
            f"rollout.max_model_len {job.max_model_len} tokens needs with this model: {need / GIB:.3g} GiB{gpu} "
            f"({per_token:,} bytes a token, {GIB // per_token:,} tokens per GiB, in blocks of {KV_BLOCK_TOKENS}); "
            f"vLLM would refuse to start with it. Raise rollout.kv_cache_gib to at least {at_least:.2f}{shorter}")


def check_budget(cfg: Any, model_path: str | os.PathLike, device_bytes: int | None = None) -> Estimate | None:
    """Refuse (MemoryBudgetError, with the table and a fix) a job over its budget; None without a budget.
    ``device_bytes`` (when known) also refuses a budget larger than the device."""
    if cfg.rollout.gpu_memory_budget_gib is None:
        return None
    est = job_estimate(cfg, model_path)
    if not est.fits:
        raise MemoryBudgetError(est.refusal())
    if device_bytes is not None and est.budget_bytes > MAX_DEVICE_SHARE * device_bytes:
        raise MemoryBudgetError(f"rollout.gpu_memory_budget_gib: {est.budget_bytes / GIB:.1f} GiB is more than "
                                f"{MAX_DEVICE_SHARE:.0%} of this GPU's {device_bytes / GIB:.1f} GiB")
    split = est.split()
    if device_bytes is not None:  # both shares must be valid fractions of this device
        split.learner_fraction(device_bytes)
        split.engine_fraction(device_bytes)
    return est

