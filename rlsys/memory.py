"""GPU memory of a co-located job, estimated before anything starts: does it fit `--gpu-memory-budget-gib`?

Pure Python (no torch, no Ray): the numbers come from the model's config.json shapes and the job config, so
`rlsys train` can refuse a job that would not fit before Ray starts (exit 2, with this table and a fix), and
`rlsys tune` can search batch sizes without a GPU. The learner and the vLLM engine then get a static split of
the budget: the learner's torch allocator is capped with `torch.cuda.set_per_process_memory_fraction`, vLLM's
`gpu_memory_utilization` is sized from the remainder (actors/learner.py, actors/rollout.py).

What is counted (bytes; P = parameters, d = bytes of the weights' dtype, T = tokens of one micro-batch =
`learner.mini_bs` x sequence length, or `learner.micro_batch_tokens`, V = vocabulary, h = hidden, i = intermediate,
L = layers):
- learner: weights P*w and gradients P*w (w = d, or 4 with `learner.fp32_master`), optimizer states (8-bit Adam:
  2 bytes/param; torch AdamW: two states in the parameters' dtype, 2*P*w, i.e. 8 bytes/param in float32), the
  weight-push buffers P*d (the packer keeps a packed copy of every parameter, in the engine's dtype, for reuse,
  rlsys/weights), activations (without gradient checkpointing
  ~d*(18h + 3*kv_dim + 4i) per token per layer, the tensors autograd keeps for a Qwen2/Llama block with SDPA
  attention (no T x T matrix; K/V repeated to all heads when there is a padding mask); with it, one
  hidden state per token per layer plus one layer recomputed), logits (T*V*(d + 4 + 4 + d): the model's logits,
  their float32 copy, and in backward the float32 gradient, its cast and the un-sliced gradient:
  T*V*(3d + 8); `rlsys.algos.token_logprobs` is chunked and keeps no float32 softmax, two 256 MiB chunks of
  working set), a fragmentation margin, and a CUDA context outside the allocator's cap; with `algo.kl_coef` the
  frozen reference model's weights P*d (its no-grad forward runs before the policy's, so its logits are not on top
  of the policy's peak), with `algo.entropy_coef` one more float32 T*V gradient (the entropy's, summed into the
  logprobs');
- with `learner.lora` (rank r, A = adapter parameters = L * sum over the targeted layers of r*(in + out)): the
  learner's weights are the frozen base P*d (with `base_4bit`, the blocks' linear layers at NF4's ~0.52
  bytes/param and the rest P*d), gradients and optimizer states cover only the adapters, in float32 (peft's dtype
  for them), the push buffers only the adapters in d; activations add, per token and layer, every targeted layer's
  input cast to float32 and its r-wide float32 intermediate (peft's LoRA forward); no KL reference copy (the base with
  the adapters off is the reference); the engine adds the kept base copy of the targeted layers (rlsys/lora.py
  `LoraMerge`: their out*in parameters per layer, d bytes each);
- engine (vLLM): weights P*d, the KV cache for min(engine_max_batch, batch_size*n_samples) sequences (never less
  than one `max_model_len` sequence, which vLLM insists on), activations of one scheduler step, CUDA graphs
  (unless `enforce_eager`), and its CUDA context (outside `gpu_memory_utilization`).
The sequence length is `prompt_tokens + max_new_tokens` when the prompt length is known (`rlsys tune` measures
it for tic-tac-toe), else `max_model_len` (the worst case). The constants marked "calibrate" are first guesses to
be replaced by what the GPU runs of `python -m jobs.bench step` measure (docs/performance.md).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GIB = 1 << 30
CONTEXT_BYTES = int(0.75 * GIB)  # calibrate: CUDA context + cuBLAS/NCCL workspaces of one process (not in torch's cap)
CUDA_GRAPH_BYTES = int(0.5 * GIB)  # calibrate: vLLM's captured graphs when enforce_eager is off
ENGINE_STEP_TOKENS = 8192  # calibrate: tokens of vLLM's profiling step (max_num_batched_tokens)
LOGPROB_CHUNK_BYTES = 1 << 28  # rlsys.algos.logprobs._CHUNK_BYTES
SUGGEST_MARGIN = 0.10  # proposals leave this share of the budget unused, for what the estimate misses
FRAGMENTATION = 0.10  # of the learner's transient memory (activations, logits), plus a fixed 0.25 GiB
LEARNER_SLACK_SHARE = 0.25  # of the budget left over after both estimates: headroom for the learner's cap
MAX_DEVICE_SHARE = 0.95  # the job may not ask for more of the device than this


class MemoryBudgetError(ValueError):
    """The job does not fit its memory budget (jobs/items.py turns it into a ConfigError, exit 2)."""


# ------------------------------------------------------------------ model shapes
@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    qkv_bias: bool = True  # Qwen2 has biases on q, k and v; Llama (attention_bias=false) has none

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Hugging Face config.json dict (a multimodal model's `text_config` is used when present)."""
        text = config.get("text_config") or config
        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            shape = cls(
                hidden=hidden, layers=int(text["num_hidden_layers"]), heads=heads,
                kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate=int(text["intermediate_size"]), vocab=int(text["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
                qkv_bias=bool(text.get("attention_bias", text.get("model_type", config.get("model_type")) == "qwen2")),
            )
        except KeyError as err:
            raise ValueError(f"model config lacks {err.args[0]!r}; cannot estimate its memory") from None
        return shape

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of a Qwen2/Llama-style decoder (tied embeddings counted once)."""
        h, q_dim, kv = self.hidden, self.heads * self.head_dim, self.kv_dim
        attn = h * q_dim + 2 * h * kv + q_dim * h + ((q_dim + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h  # + the two RMSNorm weights
        embed = self.vocab * h * (1 if self.tied else 2)
        return embed + self.layers * per_layer + h  # + the final norm

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear layer of one decoder block, by its Hugging Face name."""
        h, q_dim, kv, i = self.hidden, self.heads * self.head_dim, self.kv_dim, self.intermediate
        return {"q_proj": (q_dim, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q_dim),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of rank ``rank`` on the ``targets`` layers of every block."""
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets if t in shapes)

    def target_params(self, targets: tuple[str, ...]) -> int:
        """Weights of the ``targets`` layers of every block (what LoRA's engine-side merge keeps a copy of)."""
        shapes = self.linear_shapes()
        return self.layers * sum(shapes[t][0] * shapes[t][1] for t in targets if t in shapes)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes  # K and V of every layer


def read_model_config(model_path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a local model folder; a hub id goes through transformers' AutoConfig (imported only then)."""
    path = Path(model_path)
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    from transformers import AutoConfig  # noqa: PLC0415 (hub ids only)

    return AutoConfig.from_pretrained(str(model_path)).to_dict()


# ------------------------------------------------------------------ the job's shape
@dataclass(frozen=True)
class JobShape:
    """The parts of a job config that the estimate depends on."""

    dtype_bytes: int = 2  # compute dtype: the engine's weights, activations, logits (bfloat16 on the GPU)
    param_bytes: int | None = None  # the learner's weights and gradients (4 with fp32 masters); None = dtype_bytes
    adam_8bit: bool = False
    gradient_checkpointing: bool = False
    mini_bs: int = 4  # sequences per forward/backward
    micro_batch_tokens: int | None = None  # learner.micro_batch_tokens: padded positions per forward/backward
    seq_len: int = 2048  # tokens of one training sequence (prompt + completion)
    max_model_len: int = 2048
    engine_max_batch: int = 64  # vLLM max_num_seqs
    concurrency: int = 16  # episodes in flight in one step (batch_size x n_samples)
    enforce_eager: bool = False
    reference_model: bool = False  # algo.kl_coef: a frozen copy of the initial weights in the learner
    entropy_bonus: bool = False  # algo.entropy_coef: the entropy's logit gradient in backward
    lora_rank: int = 0  # learner.lora.rank when learner.lora.enabled, else 0 (full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # learner.lora.target_modules
    lora_base_4bit: bool = False  # learner.lora.base_4bit

    @property
    def micro_tokens(self) -> int:
        """Padded positions of the largest micro-batch: `mini_bs` rows of `seq_len`, or the token budget (a row
        longer than the budget runs alone)."""
        if self.micro_batch_tokens:
            return max(self.micro_batch_tokens, self.seq_len)
        return self.mini_bs * self.seq_len

    @classmethod
    def from_config(cls, cfg: Any, prompt_tokens: int | None = None) -> JobShape:
        """From an rlsys `Config`; ``prompt_tokens`` (when known) bounds the sequence length below max_model_len."""
        r = cfg.rollout
        seq = r.max_model_len if prompt_tokens is None else min(r.max_model_len, prompt_tokens + r.max_new_tokens)
        d = 4 if cfg.model.dtype == "float32" else 2
        master = 4 if getattr(cfg.learner, "fp32_master", False) else d
        lora = getattr(cfg.learner, "lora", None)
        lora_on = bool(lora is not None and lora.enabled)
        return cls(dtype_bytes=d, param_bytes=master, adam_8bit=cfg.learner.adam_8bit,
                   gradient_checkpointing=cfg.model.gradient_checkpointing, mini_bs=cfg.learner.mini_bs,
                   micro_batch_tokens=getattr(cfg.learner, "micro_batch_tokens", None), seq_len=seq,
                   max_model_len=r.max_model_len, engine_max_batch=r.engine_max_batch,
                   concurrency=r.batch_size * (1 if cfg.algo.name == "sft" else r.n_samples),
                   enforce_eager=r.enforce_eager,
                   # with LoRA the KL reference is the frozen base with the adapters off: no copy
                   reference_model=bool(getattr(cfg.algo, "kl_coef", 0.0)) and not lora_on,
                   entropy_bonus=bool(getattr(cfg.algo, "entropy_coef", 0.0)),
                   lora_rank=lora.rank if lora_on else 0, lora_targets=tuple(lora.target_modules) if lora_on else (),
                   lora_base_4bit=bool(lora_on and lora.base_4bit))


# ------------------------------------------------------------------ the estimate
@dataclass
class Estimate:
    model: ModelShape
    job: JobShape
    learner: dict[str, int] = field(default_factory=dict)  # component -> bytes
    engine: dict[str, int] = field(default_factory=dict)
    budget_bytes: int | None = None

    @property
    def learner_bytes(self) -> int:
        return sum(self.learner.values())

    @property
    def engine_bytes(self) -> int:
        return sum(self.engine.values())

    @property
    def total_bytes(self) -> int:
        return self.learner_bytes + self.engine_bytes

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    def split(self) -> BudgetSplit:
        """Learner and engine shares of the budget: each its estimate, the learner a quarter of what is left
        (headroom for its cap), the engine the rest (a larger KV cache than the minimum)."""
        if self.budget_bytes is None:
            raise ValueError("no budget to split")
        slack = self.budget_bytes - self.total_bytes
        if slack < 0:
            raise MemoryBudgetError(self.refusal())
        learner = self.learner_bytes + int(LEARNER_SLACK_SHARE * slack)
        return BudgetSplit(learner_bytes=learner, engine_bytes=self.budget_bytes - learner,
                           engine_outside_bytes=self.engine.get(LORA_KEPT, 0))

    def table(self) -> str:
        p = self.model.num_params()
        j = self.job
        master = "" if (j.param_bytes or j.dtype_bytes) == j.dtype_bytes else f" ({j.param_bytes}-byte learner masters)"
        if j.lora_rank:
            master += (f", LoRA r={j.lora_rank} on {','.join(j.lora_targets)} "
                       f"({self.model.lora_params(j.lora_rank, j.lora_targets) / 1e6:.1f}M adapter parameters"
                       f"{', 4-bit base' if j.lora_base_4bit else ''})")
        lines = [f"memory estimate: {p / 1e9:.3f}B parameters, {j.dtype_bytes}-byte weights{master}, "
                 f"{'8-bit' if j.adam_8bit else 'torch'} AdamW, gradient checkpointing "
                 f"{'on' if j.gradient_checkpointing else 'off'}, micro-batch {_micro_text(j)}, "
                 f"engine {min(j.engine_max_batch, j.concurrency)} sequences x {j.seq_len} tokens "
                 f"(max_model_len {j.max_model_len})"]
        for side, parts in (("learner", self.learner), ("engine (vLLM)", self.engine)):
            lines.append(f"  {side:<16}{sum(parts.values()) / GIB:8.2f} GiB")
            lines += [f"    {name:<24}{b / GIB:8.2f} GiB" for name, b in parts.items()]
        budget = "" if self.budget_bytes is None else f" of a {self.budget_bytes / GIB:.2f} GiB budget"
        lines.append(f"  {'total':<16}{self.total_bytes / GIB:8.2f} GiB{budget}")
        return "\n".join(lines)

    def refusal(self) -> str:
        lines = [f"rollout.gpu_memory_budget_gib: the job needs ~{self.total_bytes / GIB:.1f} GiB, over its "
                 f"{(self.budget_bytes or 0) / GIB:.1f} GiB budget", self.table()]
        fix = suggest(self.model, self.job, (self.budget_bytes or 0) / GIB)
        if fix is not None:
            lines.append(f"fits ({fix.estimate.total_bytes / GIB:.1f} GiB) with: {' '.join(fix.flags())}")
        else:
            lines.append("no smaller batch fits either: raise the budget or use a smaller model "
                         f"(minimum ~{minimum_bytes(self.model, self.job) / GIB:.1f} GiB)")
        lines.append("(`rlsys tune` searches the settings; docs/performance.md says how the estimate is made)")
        return "\n".join(lines)


@dataclass(frozen=True)
class BudgetSplit:
    learner_bytes: int  # the learner process: torch's cap + its CUDA context
    engine_bytes: int  # the vLLM engine process: gpu_memory_utilization * device + its CUDA context
    # of engine_bytes, what the engine process allocates beside vLLM's own pool (LoRA's kept base copy), which vLLM's
    # gpu_memory_utilization must leave free
    engine_outside_bytes: int = 0

    def learner_fraction(self, device_bytes: int) -> float:
        """For torch.cuda.set_per_process_memory_fraction (the cap covers torch's allocator, not the context)."""
        return _fraction(self.learner_bytes - CONTEXT_BYTES, device_bytes, "learner")

    def engine_fraction(self, device_bytes: int) -> float:
        """vLLM's gpu_memory_utilization (vLLM counts from after its CUDA context exists)."""
        return _fraction(self.engine_bytes - CONTEXT_BYTES - self.engine_outside_bytes, device_bytes, "vLLM")


def _fraction(nbytes: int, device_bytes: int, who: str) -> float:
    if device_bytes <= 0:
        raise ValueError(f"device total memory must be > 0, got {device_bytes}")
    f = nbytes / device_bytes
    if not 0 < f <= MAX_DEVICE_SHARE:
        raise MemoryBudgetError(f"rollout.gpu_memory_budget_gib: {who}'s share {nbytes / GIB:.2f} GiB is {f:.0%} of "
                                f"this GPU's {device_bytes / GIB:.1f} GiB; keep the budget within the device")
    return f


def estimate(model: ModelShape, job: JobShape, budget_gib: float | None = None) -> Estimate:
    p, d = model.num_params(), job.dtype_bytes
    w = job.param_bytes or d  # learner weights and gradients (fp32 masters: 4)
    h, i, L, V = model.hidden, model.intermediate, model.layers, model.vocab
    tokens = job.micro_tokens  # one micro-batch
    per_token_layer = d * (18 * h + 3 * model.kv_dim + 4 * i)
    if job.gradient_checkpointing:
        activations = tokens * (L * d * h + per_token_layer)  # one hidden state per layer + one layer recomputed
    else:
        activations = tokens * L * per_token_layer
    activations += tokens * 10 * h  # embeddings, final norm
    # model logits (d), their float32 copy (4), in backward the float32 gradient (4), its cast (d) and the
    # un-sliced gradient of logits[:, :-1] (d); float32 weights make the copy an alias: 12. Plus the chunked
    # softmax's working set in token_logprobs (two chunks).
    logits = tokens * V * (12 if d == 4 else 3 * d + 8) + 2 * LOGPROB_CHUNK_BYTES
    if job.entropy_bonus:  # the entropy's float32 gradient of the logits, summed into the logprobs' in backward
        logits += tokens * V * 4
    if job.lora_rank:
        return _lora_estimate(model, job, activations, logits, budget_gib)
    learner = {
        "weights": p * w,
        "gradients": p * w,
        "optimizer states": p * 2 if job.adam_8bit else 2 * p * w,
        "weight-push buffers": p * d,  # packed in the engine's dtype
        **({"reference model": p * d} if job.reference_model else {}),  # frozen, in the compute dtype
        "activations": activations,
        "logits": logits,
        "fragmentation": int(FRAGMENTATION * (activations + logits) + 0.25 * GIB),
        "CUDA context": CONTEXT_BYTES,
    }
    engine = _engine_parts(model, job)
    budget = None if budget_gib is None else int(budget_gib * GIB)
    return Estimate(model=model, job=job, learner=learner, engine=engine, budget_bytes=budget)


LORA_KEPT = "kept LoRA base copy"  # the engine part allocated beside vLLM's pool (BudgetSplit.engine_outside_bytes)
NF4_BYTES_PER_PARAM = 0.5 + 4 / 64 / 4 + 4 / 256 / 64  # 4 bits + double-quantized absmax (8-bit per 64, fp32 per 256)


def _engine_parts(model: ModelShape, job: JobShape) -> dict[str, int]:
    """The vLLM engine's share: weights, KV cache, one step's activations, CUDA graphs, context."""
    d, h, i, V = job.dtype_bytes, model.hidden, model.intermediate, model.vocab
    in_flight = min(job.engine_max_batch, job.concurrency)
    kv_tokens = max(job.max_model_len, in_flight * job.seq_len)
    step_tokens = max(ENGINE_STEP_TOKENS, job.max_model_len)
    return {
        "weights": model.num_params() * d,
        "KV cache": kv_tokens * model.kv_bytes_per_token(d),
        "activations": step_tokens * d * (4 * h + 3 * i) + job.engine_max_batch * V * 4 * 2,
        "CUDA graphs": 0 if job.enforce_eager else CUDA_GRAPH_BYTES,
        "CUDA context": CONTEXT_BYTES,
    }


def _lora_estimate(model: ModelShape, job: JobShape, activations: int, logits: int,
                   budget_gib: float | None) -> Estimate:
    """`estimate` with `learner.lora`: a frozen base (optionally 4-bit), float32 adapters, the engine's kept copy."""
    p, d = model.num_params(), job.dtype_bytes
    adapters = model.lora_params(job.lora_rank, job.lora_targets)
    shapes = model.linear_shapes()
    targets = [t for t in job.lora_targets if t in shapes]
    tokens = job.micro_tokens
    # peft casts each targeted layer's input to the adapters' float32 and keeps it and the r-wide product for backward
    activations += tokens * model.layers * sum(4 * (shapes[t][1] + job.lora_rank) for t in targets)
    if job.lora_base_4bit:
        blocks = model.target_params(tuple(shapes))  # bitsandbytes quantizes every linear layer of the blocks
        base = int(blocks * NF4_BYTES_PER_PARAM) + (p - blocks) * d
    else:
        base = p * d
    learner = {
        "frozen base weights": base,
        "adapters": adapters * 4,
        "adapter gradients": adapters * 4,
        "optimizer states": adapters * 2 if job.adam_8bit else 2 * adapters * 4,
        "weight-push buffers": adapters * d,  # only the adapters travel, cast to the engine's dtype
        "activations": activations,  # (the KL reference is the base with the adapters off: no copy)
        "logits": logits,
        "fragmentation": int(FRAGMENTATION * (activations + logits) + 0.25 * GIB),
        "CUDA context": CONTEXT_BYTES,
    }
    engine = _engine_parts(model, job)
    engine[LORA_KEPT] = model.target_params(tuple(targets)) * d  # rlsys/lora.py LoraMerge
    budget = None if budget_gib is None else int(budget_gib * GIB)
    return Estimate(model=model, job=job, learner=learner, engine=engine, budget_bytes=budget)


def minimum_bytes(model: ModelShape, job: JobShape) -> int:
    """The smallest estimate over the settings `suggest` may change (one sequence, checkpointing, 8-bit Adam)."""
    small = replace(job, mini_bs=1, gradient_checkpointing=True, adam_8bit=True, engine_max_batch=1)
    return estimate(model, small).total_bytes


# ------------------------------------------------------------------ searching settings that fit
@dataclass(frozen=True)
class Proposal:
    job: JobShape
    estimate: Estimate
    changed: dict[str, Any]  # dotted config key -> new value

    def flags(self) -> list[str]:
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.changed.items()]


def _micro_text(job: JobShape) -> str:
    if job.micro_batch_tokens:
        return f"{job.micro_tokens} padded tokens (learner.micro_batch_tokens)"
    return f"{job.mini_bs} x {job.seq_len} tokens"


def _divisors_desc(n: int) -> list[int]:
    return [k for k in range(n, 0, -1) if n % k == 0]


def suggest(model: ModelShape, job: JobShape, budget_gib: float, *, per_minibatch: int | None = None,
            max_concurrency: int | None = None, allow_8bit: bool = True) -> Proposal | None:
    """The settings that fit ``budget_gib`` and look fastest, or None. Searched: gradient checkpointing, 8-bit Adam,
    the micro-batch (a divisor of ``per_minibatch``, default the current micro-batch) and the engine's concurrent
    sequences (up to ``max_concurrency``, default the current min(engine_max_batch, episodes per step)).
    "Fastest" is a rough cost model: checkpointing costs ~30% of learner time, a micro-batch of b sequences
    1 + 1/b per sequence (launch overhead), c concurrent sequences 1 + 4/c of rollout time; 8-bit Adam is free.
    Ties go to the fewest changes. A proposal leaves SUGGEST_MARGIN of the budget unused."""
    current = min(job.engine_max_batch, job.concurrency)
    top = max_concurrency or current
    concurrency = [top] + [c for c in (256, 128, 64, 32, 16, 8, 4, 2, 1) if c < top]
    adam = [job.adam_8bit] + ([True] if allow_8bit and not job.adam_8bit else [])
    checkpointing = [job.gradient_checkpointing] + ([True] if not job.gradient_checkpointing else [])
    best: tuple[float, int, Proposal] | None = None
    for eight_bit in adam:
        for ckpt in checkpointing:
            # a token budget sizes the micro-batches instead (kept as the user set it)
            for mbs in [job.mini_bs] if job.micro_batch_tokens else _divisors_desc(per_minibatch or job.mini_bs):
                for conc in concurrency:
                    engine_max = conc if conc != current else job.engine_max_batch
                    cand = replace(job, adam_8bit=eight_bit, gradient_checkpointing=ckpt, mini_bs=mbs,
                                   engine_max_batch=engine_max)
                    est = estimate(model, cand, budget_gib)
                    if est.total_bytes > (1 - SUGGEST_MARGIN) * est.budget_bytes:
                        continue
                    cost = (1.3 if ckpt else 1.0) * (1 + 1 / mbs) + (1 + 4 / conc)
                    prop = Proposal(job=cand, estimate=est, changed=_changes(job, cand))
                    key = (round(cost, 6), len(prop.changed))
                    if best is None or key < best[:2]:
                        best = (*key, prop)
    return best[2] if best else None


def _changes(old: JobShape, new: JobShape) -> dict[str, Any]:
    keys = {"adam_8bit": "learner.adam_8bit", "gradient_checkpointing": "model.gradient_checkpointing",
            "mini_bs": "learner.mini_bs", "engine_max_batch": "rollout.engine_max_batch",
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
    """What vLLM holds under `rollout.kv_cache_gib` (and no budget): the estimate's weights, activations and CUDA
    graphs plus that KV cache, its CUDA context left out as in a budget's engine share (actors/rollout.py)."""
    engine = dict(job_estimate(cfg, model_path).engine)
    engine["KV cache"] = int(cfg.rollout.kv_cache_gib * GIB)
    engine.pop("CUDA context", None)
    engine.pop(LORA_KEPT, None)  # beside vLLM's pool, not in its gpu_memory_utilization
    return sum(engine.values())


def _nvml_memory_info():
    """NVML's memory info (total, used, free) of the first visible GPU, or None (no NVML, no GPU). Makes no CUDA
    context, so a driver can read it before Ray or vLLM start."""
    try:
        import pynvml  # noqa: PLC0415 (nvidia-ml-py, a vLLM dependency)

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        if visible.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible))
        return pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # ImportError, NVMLError (no driver, no device): the callers treat None as unknown
        return None


def device_total_bytes_nvml() -> int | None:
    """Total memory of the first visible GPU, or None without NVML."""
    info = _nvml_memory_info()
    return None if info is None else int(info.total)


def device_used_bytes_nvml() -> int | None:
    """Memory in use on the first visible GPU (every process on it), or None without NVML."""
    info = _nvml_memory_info()
    return None if info is None else int(info.used)


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

