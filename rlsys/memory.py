"""GPU memory of a co-located job, estimated before anything starts: does it fit `--gpu-memory-budget-gib`?

Pure Python (no torch, no Ray): the numbers come from the model's config.json shapes and the job config, so
`rlsys train` can refuse a job that would not fit before Ray starts (exit 2, with this table and a fix), and
`rlsys tune` can search batch sizes without a GPU (rlsys/budget.py: a config's estimate, its split, the search).
The learner and the vLLM engine then get a static split of the budget: the learner's torch allocator is capped with
`torch.cuda.set_per_process_memory_fraction`, vLLM's `gpu_memory_utilization` is sized from the remainder
(actors/learner_setup.py, actors/rollout.py).

What is counted (bytes; P = parameters, d = bytes of the compute dtype, w = bytes of the learner's weights, V =
vocabulary, h = hidden, q = heads x head_dim, i = intermediate, L = layers, r = LoRA rank):
- learner, static: weights P*w and gradients P*w (w = d, or 4 with `learner.fp32_master`), optimizer states (8-bit
  Adam: 2 bytes/param; torch AdamW: two states in the parameters' dtype, 2*P*w, i.e. 8 bytes/param in float32), the
  weight-push buffers P*d (the packer keeps a packed copy of every parameter, in the engine's dtype, for reuse,
  rlsys/weights); with `algo.kl_coef` the frozen reference model's weights P*d (its no-grad forward runs before the
  policy's, so its logits are not on top of the policy's peak);
- learner, one micro-batch (`MicroBatch`, the largest the settings allow, every answer at its longest): the positions
  it runs through the decoder blocks, through the LM head, the key/value positions attention keeps beyond the
  queries' own, and the attention masks' entries. Without prefix sharing (or with the prompt length unknown) a
  micro-batch is `learner.mini_bs` rows of `seq_len`, or `learner.micro_batch_tokens` padded positions (rows x
  longest row; a longer row runs alone), every position through the decoder and the LM head (B x T x V logits).
  With `learner.prefix_sharing` (rlsys/prefix.py: GSPO/GRPO, a known prompt length, `rollout.n_samples` >= 2, no
  gradient checkpointing, full-attention layers) the rows of a group share their prompt: per micro-batch of R rows
  (R = mini_bs, or micro_batch_tokens // (prompt + answer)) each group present runs its prompt minus its last token
  once through the decoder only (no LM head), and each row its suffix (the prompt's last token and the answer) on
  that KV cache, decoder and LM head over the suffix positions only; the suffix rows' attention keeps the cached
  prefix's keys and values too. A micro-batch cut inside a group holds part of it: every start within a group is
  tried and the costliest layout counted (a part of one row has no one to share with and runs the plain path,
  prompt through the LM head too). Groups are taken whole (`n_samples` rows); shorter prompts than
  `prompt_tokens` fit a few more rows into a token budget (not counted).
- activations, per decoder position and layer, what autograd keeps for backward. Full fine-tuning: ~d*(18h +
  3*kv_dim + 4i), a Qwen2/Llama block's tensors with SDPA attention (no T x T matrix; K/V repeated to all heads when
  there is a padding mask). LoRA (`learner.lora`), counted tensor by tensor (checked with saved-tensor hooks on the
  CPU against the plain and prefix-shared forwards: within 1% at Qwen 0.5B's widths; tests/unit/test_memory.py): a
  frozen base Linear keeps no input (its weight needs no gradient; its backward needs only the weight), so what is
  kept is: each RMSNorm's float32 copy
  of its input and its rsqrt (2 x (4h + 4); the normalized bf16 output is not kept, its weight being frozen), the
  attention's query, output and K/V repeated to all heads (4*d*q) and logsumexp (4 x heads), the MLP's gate,
  SiLU(gate) and up (3*d*i), and peft's branch for every targeted layer: its input cast to the adapters' float32
  (4 x in, one copy per layer, so q, k and v keep three) and the r-wide product (4r), plus dropout's mask (in
  bytes) when `learner.lora.dropout` > 0. Qwen2.5-0.5B, r=16 on all 7 projections: 84,992 bytes per position and
  layer (the full fine-tune's term plus peft's, counted before, was 113,344). Every position keeps 10h more
  (embeddings, final norm). Attention also keeps, per layer, its mask as a d-byte copy (PyTorch converts the
  boolean mask for the memory-efficient kernel, rows padded to 16 entries): queries x keys entries per row, and the
  suffix rows' extra keys/values over the cached prefix, 2*d*q per position. With gradient checkpointing one hidden
  state per position and layer plus one layer recomputed;
- logits, per LM-head position (RL: `rlsys.algos.token_logprobs` keeps the model's logits and makes their
  gradient, in their dtype, no float32 copy: V*2d) plus its chunked softmax's working set in backward (three
  float32 chunks of up to 256 MiB, 441 rows of Qwen's vocabulary: the chunk, x - lse, its exp); SFT copies its
  shifted logits (V*(3d + 8) counted, as before); `algo.entropy_coef` (or `algo.entropy_target`, whose bonus
  comes and goes) adds another logits-sized gradient (4 bytes an entry);
- a fragmentation margin (of the transient memory, plus a fixed 0.25 GiB) and a CUDA context outside the
  allocator's cap;
- with `learner.lora` (A = adapter parameters = L * sum over the targeted layers of r*(in + out)): the learner's
  weights are the frozen base P*d (with `base_4bit`, the blocks' linear layers at NF4's ~0.52 bytes/param and the
  rest P*d), gradients and optimizer states cover only the adapters, in float32 (peft's dtype for them), the push
  buffers only the adapters in d; no KL reference copy (the base with the adapters off is the reference); the engine
  adds the kept base copy of the targeted layers (rlsys/lora.py `LoraMerge`: their out*in parameters per layer, d
  bytes each);
- engine (vLLM): weights P*d, the KV cache for min(engine_max_batch, boards in flight x n_samples) sequences (the
  boards: `batch_size`, or a dynamic-sampling round's most, `sampled_groups`; never less than one `max_model_len`
  sequence, which vLLM insists on) or, with `rollout.kv_cache_gib`, that fixed size (what vLLM then holds, whatever
  the sequences in flight; less than one `max_model_len` sequence is refused before Ray, rlsys/budget.py
  `kv_cache_refusal`), activations of one scheduler step, CUDA graphs (unless `enforce_eager`), and its CUDA context
  (outside `gpu_memory_utilization`).
The sequence length is `prompt_tokens + max_new_tokens` when the prompt length is known (`rollout.budget_prompt_tokens`,
which `rlsys train` and `rlsys tune` measure for a single-request environment), else `max_model_len` (the worst case, and no prefix sharing counted). Calibrated against the
learner's measured peaks (docs/performance.md, section 4, "The learner's estimate against the measured peaks"):
every one is at or under the estimate, by at most 1.6x. The constants marked "calibrate" are first guesses.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

GIB = 1 << 30
# one process's memory outside torch's allocator and vLLM's pool: its CUDA context, loaded kernels, cuBLAS/NCCL
# workspaces. Calibrated: the whole device (NVML) less what the learner's allocator reserved and vLLM said it
# holds (weights, KV cache, activations) left 1.78, 1.91 and 2.06 GiB for the two processes in three H100/H200
# runs (7B and 14B LoRA, 1.5B full fine-tune: docs/performance.md, "The fixed memory of a process")
CONTEXT_BYTES = 1 * GIB
CUDA_GRAPH_BYTES = int(0.5 * GIB)  # calibrate: vLLM's captured graphs when enforce_eager is off
# the most tokens one vLLM step runs (max_num_batched_tokens): vLLM 0.26's default for AsyncLLM, whose chunked
# prefill is on (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS; "Chunked prefill is enabled with
# max_num_batched_tokens=2048" in every GPU log). vLLM's own profile of the 7B shape: 0.30 GiB peak activation
ENGINE_STEP_TOKENS = 2048
LOGPROB_CHUNK_BYTES = 1 << 28  # rlsys.algos.logprobs._CHUNK_BYTES
LOGPROB_CHUNKS = 3  # float32 chunks alive at once in token_logprobs' backward: the chunk, x - lse, its exp
MASK_ALIGN = 16  # the memory-efficient attention kernel pads its (converted) mask's rows to this many entries
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
    full_attention: bool = True  # every layer full attention (prefix sharing needs it: rlsys/prefix.py)

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
                full_attention=not text.get("use_sliding_window", False)
                and all(t == "full_attention" for t in (text.get("layer_types") or ["full_attention"])),
            )
        except KeyError as err:
            raise ValueError(f"model config lacks {err.args[0]!r}; cannot estimate its memory") from None
        return shape

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of a Qwen2/Llama-style decoder (tied embeddings counted once)."""
        h, q_dim, kv = self.hidden, self.q_dim, self.kv_dim
        attn = h * q_dim + 2 * h * kv + q_dim * h + ((q_dim + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate
        per_layer = attn + mlp + 2 * h  # + the two RMSNorm weights
        embed = self.vocab * h * (1 if self.tied else 2)
        return embed + self.layers * per_layer + h  # + the final norm

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear layer of one decoder block, by its Hugging Face name."""
        h, q_dim, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
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

    def kv_bytes_per_token(self, dtype_bytes: int = 2, tp_size: int = 1) -> int:
        """K and V of every layer, on one GPU of an engine: vLLM splits the KV heads over ``tp_size`` GPUs (one head
        each at least, replicated where there are fewer heads than GPUs)."""
        return 2 * self.layers * max(1, self.kv_heads // tp_size) * self.head_dim * dtype_bytes


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
    concurrency: int = 16  # episodes in flight at once in a step (`sampled_groups` x n_samples)
    enforce_eager: bool = False
    reference_model: bool = False  # algo.kl_coef: a frozen copy of the initial weights in the learner
    entropy_bonus: bool = False  # algo.entropy_coef or entropy_target: the entropy's logit gradient in backward
    lora_rank: int = 0  # learner.lora.rank when learner.lora.enabled, else 0 (full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # learner.lora.target_modules
    lora_base_4bit: bool = False  # learner.lora.base_4bit
    lora_dropout: bool = False  # learner.lora.dropout > 0: a dropout mask per targeted layer's input
    lora_serve: str = "merged"  # learner.lora.serve: `adapter` = vLLM's LoRA slot instead of the kept base copy
    prefix_sharing: bool = True  # learner.prefix_sharing (whether it applies: `shares_prefixes`)
    prompt_tokens: int | None = None  # the prompts' length when known: the part of seq_len a group shares
    n_samples: int = 1  # rows of a group (rollout.n_samples): the rows that share one prompt
    sft: bool = False  # algo.name == "sft": no prefix sharing, the shifted logits copied
    kv_cache_bytes: int | None = None  # rollout.kv_cache_gib: vLLM's fixed KV cache; None = sized by the sequences

    @property
    def shares_prefixes(self) -> bool:
        """Whether the learner runs a group's prompt once (rlsys/prefix.py): `learner.prefix_sharing`, not SFT, no
        gradient checkpointing (it drops the KV cache), groups of 2 or more, and a known prompt shorter than the
        sequence (unknown: counted as the plain path, the worst case). The model's side: `ModelShape.full_attention`."""
        return (self.prefix_sharing and not self.sft and not self.gradient_checkpointing and self.n_samples >= 2
                and self.prompt_tokens is not None and 2 <= self.prompt_tokens < self.seq_len)

    @property
    def micro_rows(self) -> int:
        """Rows of the largest micro-batch, every row `seq_len` long: `mini_bs`, or as many as the token budget holds
        (one at least)."""
        if self.micro_batch_tokens:
            return max(1, self.micro_batch_tokens // self.seq_len)
        return self.mini_bs

    @property
    def micro_tokens(self) -> int:
        """Padded positions of the largest micro-batch: `mini_bs` rows of `seq_len`, or the token budget (a row
        longer than the budget runs alone)."""
        if self.micro_batch_tokens:
            return max(self.micro_batch_tokens, self.seq_len)
        return self.mini_bs * self.seq_len

    @classmethod
    def from_config(cls, cfg: Any, prompt_tokens: int | None = None) -> JobShape:
        """From an rlsys `Config`; ``prompt_tokens`` (when known; else the config's `rollout.budget_prompt_tokens`)
        bounds the sequence length below max_model_len."""
        r = cfg.rollout
        if prompt_tokens is None:
            prompt_tokens = getattr(r, "budget_prompt_tokens", None)
        seq = r.max_model_len if prompt_tokens is None else min(r.max_model_len, prompt_tokens + r.max_new_tokens)
        d = 4 if cfg.model.dtype == "float32" else 2
        master = 4 if getattr(cfg.learner, "fp32_master", False) else d
        lora = getattr(cfg.learner, "lora", None)
        lora_on = bool(lora is not None and lora.enabled)
        sft = cfg.algo.name == "sft"
        return cls(dtype_bytes=d, param_bytes=master, adam_8bit=cfg.learner.adam_8bit,
                   gradient_checkpointing=cfg.model.gradient_checkpointing, mini_bs=cfg.learner.mini_bs,
                   micro_batch_tokens=getattr(cfg.learner, "micro_batch_tokens", None), seq_len=seq,
                   max_model_len=r.max_model_len, engine_max_batch=r.engine_max_batch,
                   concurrency=sampled_groups(cfg) * (1 if sft else r.n_samples),
                   enforce_eager=r.enforce_eager,
                   # with LoRA the KL reference is the frozen base with the adapters off: no copy
                   reference_model=bool(getattr(cfg.algo, "kl_coef", 0.0)) and not lora_on,
                   # algo.entropy_target: an adaptive bonus, on whenever the entropy is below the target
                   entropy_bonus=bool(getattr(cfg.algo, "entropy_coef", 0.0))
                   or getattr(cfg.algo, "entropy_target", None) is not None,
                   lora_rank=lora.rank if lora_on else 0, lora_targets=tuple(lora.target_modules) if lora_on else (),
                   lora_base_4bit=bool(lora_on and lora.base_4bit),
                   lora_dropout=bool(lora_on and getattr(lora, "dropout", 0.0) > 0),
                   lora_serve=str(getattr(lora, "serve", "merged")) if lora_on else "merged",
                   prefix_sharing=bool(getattr(cfg.learner, "prefix_sharing", False)) and not sft,
                   prompt_tokens=prompt_tokens, n_samples=1 if sft else r.n_samples, sft=sft,
                   kv_cache_bytes=None if getattr(r, "kv_cache_gib", None) is None else int(r.kv_cache_gib * GIB))


# ------------------------------------------------------------------ one micro-batch, as the learner runs it
@dataclass(frozen=True)
class MicroBatch:
    """The positions one micro-batch runs (see the module docstring): what its activations and logits scale with."""

    rows: int
    decoder: int  # positions through the decoder blocks (autograd keeps their activations)
    logits: int  # positions through the LM head
    cached_kv: int = 0  # key/value positions the suffix rows' attention keeps beyond their own: the cached prefixes
    mask: int = 0  # attention-mask entries (queries x padded keys) kept per layer
    prefixes: int = 0  # prompts run once for their group (prefix sharing)
    plain_rows: int = 0  # rows on the plain full-length path

    def text(self, job: JobShape) -> str:
        if not self.prefixes:
            return f"{self.decoder} positions through the decoder and the LM head"
        shared = self.rows - self.plain_rows
        plain = f" + {self.plain_rows} row(s) of {job.seq_len} alone" if self.plain_rows else ""
        return (f"prefix sharing: {self.prefixes} prompt(s) x {job.prompt_tokens - 1} + {shared} suffixes x "
                f"{job.seq_len - job.prompt_tokens + 1}{plain} = {self.decoder} decoder, "
                f"{self.logits} LM-head positions")


def _padded(n: int) -> int:
    return -(-n // MASK_ALIGN) * MASK_ALIGN


def micro_batch_layouts(model: ModelShape, job: JobShape) -> list[MicroBatch]:
    """The largest micro-batch `job` allows, every row `seq_len` long: one layout on the plain path, or with prefix
    sharing one per place the micro-batch may start within a group (`estimate` counts the costliest)."""
    T = job.seq_len
    if not (job.shares_prefixes and model.full_attention):
        positions = job.micro_tokens  # rows x T, or the token budget (padded positions; a longer row alone)
        rows = job.micro_rows
        return [MicroBatch(rows=rows, decoder=positions, logits=positions, mask=positions * _padded(T),
                           plain_rows=rows)]
    prefix = job.prompt_tokens - 1  # the prompt's last token goes with the suffix: its logits predict the answer
    suffix = T - prefix
    n, rows = job.n_samples, job.micro_rows
    layouts = []
    for start in range(n):  # the micro-batch begins `start` rows into a group
        pieces, left = [], rows
        while left:
            k = min(left, n - start if not pieces else n)
            pieces.append(k)
            left -= k
        alone = sum(k == 1 for k in pieces)  # a group's single row here: nothing to share, the plain path
        shared = [k for k in pieces if k > 1]
        layout = MicroBatch(rows=rows, decoder=alone * T + len(shared) * prefix + sum(shared) * suffix,
                            logits=alone * T + sum(shared) * suffix, cached_kv=sum(shared) * prefix,
                            mask=alone * T * _padded(T) + sum(shared) * suffix * _padded(prefix + suffix),
                            prefixes=len(shared), plain_rows=alone)
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def _token_layer_bytes(model: ModelShape, job: JobShape) -> int:
    """Activations autograd keeps per decoder position and layer, its own keys/values included (module docstring)."""
    d, h, i = job.dtype_bytes, model.hidden, model.intermediate
    if not job.lora_rank:
        return d * (18 * h + 3 * model.kv_dim + 4 * i)
    shapes = model.linear_shapes()
    base = 2 * (4 * h + 4) + 4 * d * model.q_dim + 4 * model.heads + 3 * d * i  # norms, attention, MLP
    # peft: each targeted layer's input cast to float32 (one copy per layer) and the r-wide product
    lora = sum(4 * (shapes[t][1] + job.lora_rank) + (shapes[t][1] if job.lora_dropout else 0)
               for t in job.lora_targets if t in shapes)
    return base + lora


def _transient(model: ModelShape, job: JobShape, micro: MicroBatch) -> tuple[int, int]:
    """(activations, logits) bytes of one micro-batch."""
    d, h, L, V = job.dtype_bytes, model.hidden, model.layers, model.vocab
    per_layer = _token_layer_bytes(model, job)
    if job.gradient_checkpointing:  # one hidden state per position and layer + one layer recomputed
        activations = micro.decoder * (L * d * h + per_layer) + d * micro.mask
    else:
        activations = L * (micro.decoder * per_layer + micro.cached_kv * 2 * d * model.q_dim + d * micro.mask)
    activations += micro.decoder * 10 * h  # embeddings, final norm
    # RL: the model's logits and their gradient, both in their dtype (token_logprobs keeps no float32 copy). SFT
    # copies its shifted logits: counted as before, (3d + 8) (12 for float32 logits). Plus the chunked softmax's
    # working set in backward.
    per_entry = (12 if d == 4 else 3 * d + 8) if job.sft else 2 * d
    chunk = min(LOGPROB_CHUNK_BYTES // (4 * V), micro.logits) * 4 * V  # rows of float32 logits a chunk holds
    logits = micro.logits * V * per_entry + LOGPROB_CHUNKS * chunk
    if job.entropy_bonus:  # the entropy's gradient of the logits, summed into the logprobs' in backward
        logits += micro.logits * V * 4
    return activations, logits


def learner_micro_batch(model: ModelShape, job: JobShape) -> tuple[MicroBatch, int, int]:
    """The costliest micro-batch layout and its (activations, logits) bytes."""
    best = None
    for micro in micro_batch_layouts(model, job):
        act, logits = _transient(model, job, micro)
        if best is None or act + logits > best[1] + best[2]:
            best = (micro, act, logits)
    return best


# ------------------------------------------------------------------ the estimate
@dataclass
class Estimate:
    model: ModelShape
    job: JobShape
    learner: dict[str, int] = field(default_factory=dict)  # component -> bytes
    engine: dict[str, int] = field(default_factory=dict)
    budget_bytes: int | None = None
    micro: MicroBatch | None = None  # the micro-batch the learner's activations and logits were counted for

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
            lines += [f"    {self._label(name):<24}{b / GIB:8.2f} GiB" for name, b in parts.items()]
        if self.micro is not None and self.micro.prefixes:
            lines.insert(1, f"  largest micro-batch: {self.micro.text(j)}")
        budget = "" if self.budget_bytes is None else f" of a {self.budget_bytes / GIB:.2f} GiB budget"
        lines.append(f"  {'total':<16}{self.total_bytes / GIB:8.2f} GiB{budget}")
        return "\n".join(lines)

    def _label(self, name: str) -> str:
        """A part's name in the table: the engine's KV cache says when it is the size the config fixed."""
        return f"{name} (kv_cache_gib)" if name == "KV cache" and self.job.kv_cache_bytes is not None else name

    def refusal(self) -> str:
        lines = [f"rollout.gpu_memory_budget_gib: the job needs ~{self.total_bytes / GIB:.1f} GiB, over its "
                 f"{(self.budget_bytes or 0) / GIB:.1f} GiB budget", self.table()]
        from rlsys.budget import suggest  # noqa: PLC0415 (it searches with `estimate`)

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
    micro, activations, logits = learner_micro_batch(model, job)
    if job.lora_rank:
        return _lora_estimate(model, job, micro, activations, logits, budget_gib)
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
    return Estimate(model=model, job=job, learner=learner, engine=engine, budget_bytes=budget, micro=micro)


LORA_KEPT = "kept LoRA base copy"  # the engine part allocated beside vLLM's pool (BudgetSplit.engine_outside_bytes)
LORA_SLOT = "LoRA adapter slot"  # learner.lora.serve = adapter: vLLM's A and B buffers of one adapter
VLLM_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one vLLM layer each, LoRA-wrapped whole
NF4_BYTES_PER_PARAM = 0.5 + 4 / 64 / 4 + 4 / 256 / 64  # 4 bits + double-quantized absmax (8-bit per 64, fp32 per 256)


def _engine_parts(model: ModelShape, job: JobShape) -> dict[str, int]:
    """The vLLM engine's share: weights, KV cache (the sequences in flight, or `rollout.kv_cache_gib`, which vLLM
    then allocates whatever they need), one step's activations, CUDA graphs, context."""
    d, h, i, V = job.dtype_bytes, model.hidden, model.intermediate, model.vocab
    in_flight = min(job.engine_max_batch, job.concurrency)
    kv_tokens = max(job.max_model_len, in_flight * job.seq_len)
    step_tokens = max(ENGINE_STEP_TOKENS, job.max_model_len)
    return {
        "weights": model.num_params() * d,
        "KV cache": kv_tokens * model.kv_bytes_per_token(d) if job.kv_cache_bytes is None else job.kv_cache_bytes,
        "activations": step_tokens * d * (4 * h + 3 * i) + job.engine_max_batch * V * 4 * 2,
        "CUDA graphs": 0 if job.enforce_eager else CUDA_GRAPH_BYTES,
        "CUDA context": CONTEXT_BYTES,
    }


def _lora_estimate(model: ModelShape, job: JobShape, micro: MicroBatch, activations: int, logits: int,
                   budget_gib: float | None) -> Estimate:
    """`estimate` with `learner.lora`: a frozen base (optionally 4-bit), float32 adapters, the engine's kept copy
    or, when vLLM serves the adapter, its slot (the activations, peft's included, come from `_token_layer_bytes`)."""
    p, d = model.num_params(), job.dtype_bytes
    adapters = model.lora_params(job.lora_rank, job.lora_targets)
    shapes = model.linear_shapes()
    targets = [t for t in job.lora_targets if t in shapes]
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
    if job.lora_serve == "adapter":  # vLLM's slot buffers (in its weights' pool): every slice of a wrapped fused layer
        from rlsys.lora import slot_rank  # noqa: PLC0415

        served = tuple(t for t in shapes if t in targets or any(t in g and set(g) & set(targets) for g in VLLM_FUSED))
        engine[LORA_SLOT] = model.lora_params(slot_rank(job.lora_rank), served) * d
    else:
        engine[LORA_KEPT] = model.target_params(tuple(targets)) * d  # rlsys/lora.py LoraMerge
    budget = None if budget_gib is None else int(budget_gib * GIB)
    return Estimate(model=model, job=job, learner=learner, engine=engine, budget_bytes=budget, micro=micro)


def minimum_bytes(model: ModelShape, job: JobShape) -> int:
    """The smallest estimate over the settings `suggest` may change (one sequence per micro-batch, 8-bit Adam, one
    engine sequence; with gradient checkpointing or without it, where the learner then shares the prompts)."""
    one = replace(job, mini_bs=1, micro_batch_tokens=job.seq_len if job.micro_batch_tokens else None, adam_8bit=True,
                  engine_max_batch=1)
    return min(estimate(model, replace(one, gradient_checkpointing=c)).total_bytes for c in (True, False))


def _micro_text(job: JobShape) -> str:
    if job.micro_batch_tokens:
        text = f"{job.micro_tokens} padded tokens (learner.micro_batch_tokens)"
    else:
        text = f"{job.mini_bs} x {job.seq_len} tokens"
    if job.shares_prefixes:
        text += f", {job.prompt_tokens}-token prompts in groups of {job.n_samples}"
    return text


def sampled_groups(cfg: Any) -> int:
    """Boards in flight at once in a step: `rollout.batch_size`, or under `algo.dynamic_sampling` its largest round,
    which `GroupSieve` sizes when no group had signal lately (`batch_size x max_oversample`; each round's boards run
    all at once, jobs/job.py `rollout_until_full`)."""
    from rlsys.sampling import GroupSieve

    a = cfg.algo
    enabled = a.name != "sft" and getattr(a, "dynamic_sampling", False)
    sieve = GroupSieve(want=cfg.rollout.batch_size, max_oversample=getattr(a, "max_oversample", 1.0), enabled=enabled)
    return sieve.first_round(signal_rate=0.0)


def trained_groups(cfg: Any) -> int:
    """Groups in a step's update: `rollout.batch_size`, plus `algo.unanimous_groups` where dynamic sampling brings
    them in against the batch baseline."""
    a = cfg.algo
    brings = (a.name != "sft" and getattr(a, "dynamic_sampling", False)
              and getattr(a, "unanimous_baseline", "none") != "none")
    return cfg.rollout.batch_size + (getattr(a, "unanimous_groups", 0) if brings else 0)


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
