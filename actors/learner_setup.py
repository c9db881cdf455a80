"""How a learner rank is set up (actors/learner.py): the settings it reads, its device and dtype, the optimizer and lr
schedule, the frozen KL reference, and the GPU memory cap and probe."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlsys.config import AlgoConfig, LearnerConfig, ModelConfig
from rlsys.heap import keep_freed_memory


@dataclass(frozen=True)
class LearnerSettings:
    """What a learner rank reads of the job's config (jobs/placement.py `learner_settings` takes it from one)."""

    model: ModelConfig
    learner: LearnerConfig
    algo: AlgoConfig
    seed: int = 0
    max_steps: int = 1  # the job's steps: the lr schedule spans max_steps * algo.n_minibatches optimizer steps
    budget_gib: float | None = None  # rollout.gpu_memory_budget_gib
    memory: Any = None  # its learner/engine split (rlsys.memory.BudgetSplit), None without a budget


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cpu_process_settings(device: torch.device) -> None:
    """Settings of a CPU learner's process, before its models run (none on GPU):
    - transformers' sdpa attention repeats the key/value heads to every query head whenever there is a mask (every
      learner forward has one: padding, prefix sharing), because CUDA's fused kernels take GQA only without a mask;
      torch's CPU kernel takes it with one. With the tiny model (16 query on 8 key/value heads) the repeat, its copy
      and the sum of its gradient were ~11% of the README job's learner step (0.500 -> 0.447 s); the logits are the
      same bits, the gradients within 5e-7 (tests/unit/test_learner_cpu_settings.py). transformers reads the switch
      at each call; a user's own `TRANSFORMERS_SDPA_FORCE_GQA` wins;
    - glibc keeps the freed memory of a step for the next (rlsys/heap.py)."""
    if device.type != "cpu":
        return
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    keep_freed_memory()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_optimizer(params: list[torch.nn.Parameter], lc: LearnerConfig, device: torch.device) -> torch.optim.Optimizer:
    if lc.adam_8bit:
        if device.type != "cuda":
            raise RuntimeError("learner.adam_8bit needs CUDA (bitsandbytes' 8-bit states live on the GPU); "
                               "drop --adam-8bit on CPU")
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise RuntimeError(f"learner.adam_8bit: bitsandbytes is not importable ({err}); pip install 'rlsys[gpu]'") from None
        return bnb.optim.AdamW8bit(params, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
    return torch.optim.AdamW(params, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay,
                             foreach=device.type == "cuda")


def lr_lambda(lc: LearnerConfig, optimizer_steps: int):
    """The lr factor per optimizer step: `learner.warmup_steps` of warm-up, then `learner.lr_schedule` over the
    job's ``optimizer_steps``."""
    total = max(1, optimizer_steps)
    warm, kind = lc.warmup_steps, lc.lr_schedule

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if kind == "linear":
            return 1.0 - progress
        return 1.0

    return f


def load_reference(model: ModelConfig, kl_coef: float, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen reference policy of `algo.kl_coef`: the initial model `model.ckpt` (resolved as the job did, so
    a resumed job, whose policy starts from a checkpoint, still compares against the model the run started from),
    in the compute dtype (bf16 on a GPU, no fp32 masters), eval mode, no gradients."""
    from transformers import AutoModelForCausalLM

    from rlsys.models.resolve import resolve_model

    path = resolve_model(model.ckpt)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=model.trust_remote_code)
    ref = ref.to(device).eval()
    ref.requires_grad_(False)
    print(f"rlsys: KL reference (algo.kl_coef={kl_coef}) loaded from {path}", flush=True)
    return ref


# --- GPU memory ----------------------------------------------------------------------------------
def apply_memory_budget(split: Any, budget_gib: float | None, device: torch.device) -> float | None:
    """With `rollout.gpu_memory_budget_gib` (``budget_gib``) on a GPU: cap this process's torch allocator at the
    learner's share of the budget (``split``: `rlsys.budget.budget_split`; vLLM sizes itself from the rest).
    Returns the fraction set."""
    if device.type != "cuda" or budget_gib is None:
        return None
    from rlsys.memory import GIB

    index = torch.cuda.current_device()  # set_per_process_memory_fraction wants an index, not torch.device("cuda")
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = split.learner_fraction(total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    print(f"rlsys: learner memory capped at {fraction * total / GIB:.2f} GiB ({fraction:.4f} of {total / GIB:.1f} GiB; "
          f"budget {budget_gib} GiB)", flush=True)
    return fraction


def release_cached_memory(device: torch.device, enabled: bool) -> bool:
    """`learner.empty_cache`: on a GPU, give the caching allocator's unused blocks back to the device. Returns whether
    it did."""
    if not enabled or device.type != "cuda":
        return False
    torch.cuda.empty_cache()
    return True


class MemoryProbe:
    """The GPU memory of one `train` call: torch's peak (allocated and reserved, the part the cap limits) and
    the whole device at that peak (NVML's device-wide use at the start, minus what this process had reserved
    then, plus its peak: the engine sleeps during training, so the rest does not move). Empty on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type != "cuda":
            return
        from rlsys.memory import device_used_bytes_nvml

        self.index = torch.cuda.current_device()
        torch.cuda.reset_peak_memory_stats(self.index)
        self.reserved0 = torch.cuda.memory_reserved(self.index)
        self.used0 = device_used_bytes_nvml()

    def finish(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        from rlsys.memory import GIB

        peak_reserved = torch.cuda.max_memory_reserved(self.index)
        out = {"mem/learner_peak_allocated_gib": torch.cuda.max_memory_allocated(self.index) / GIB,
               "mem/learner_peak_reserved_gib": peak_reserved / GIB,
               "mem/learner_resident_gib": torch.cuda.memory_allocated(self.index) / GIB,
               # what the allocator holds after the call (less with learner.empty_cache)
               "mem/learner_reserved_gib": torch.cuda.memory_reserved(self.index) / GIB}
        if self.used0 is not None:
            out["mem/train_device_used_gib"] = (self.used0 - self.reserved0 + peak_reserved) / GIB
        return out


# --- batching helpers --------------------------------------------------------------------------
