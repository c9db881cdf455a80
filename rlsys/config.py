"""One typed config tree for an rlsys job: defaults < TOML file < CLI flags < dotted overrides.

Every field has a docstring (shown by ``rlsys train --help-config``). The tree is validated once, at
load, and a bad value fails with its dotted path and where it came from (file, flag or override), e.g.
``learner.lr: Input should be greater than 0 (from flag --lr=-1)``. The resolved tree is written into
the run directory as ``config.resolved.toml``; loading that file gives the same config back.

CLI flags follow AReno's names (``--algo gspo --ckpt ... --n-samples 4``) so existing launch scripts map
one to one; anything else is reachable as a dotted override ``algo.clip_eps_low=3e-4``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlsys.errors import UserInputError


class ConfigError(UserInputError):
    """A config that cannot be used; the message names the field (dotted path) and its source."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    ckpt: str = "rlsys:tiny"
    """The policy to start from: a Hugging Face folder, a hub id, a `.gguf` file (dequantized once into a cached
    folder), or `rlsys:tiny` / `rlsys:tiny-h16` (the small Qwen2-architecture models rlsys builds itself, cached
    under ~/.cache/rlsys; tiny-h16 has the same size cut into 16 narrow heads, see rlsys/models/tiny.py)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for learner and engine; `auto` = float32 on CPU, bfloat16 on GPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more learner time)."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint (off: only architectures transformers knows)."""


class DataConfig(_Section):
    dataset_path: str | None = None
    """JSONL training items (SFT: chats `{"messages": [...], "tools": [...]}`). Unset: the environment's own
    (`Environment.train_items`, `sft_items` for SFT; tic-tac-toe generates `num_items` boards of `seed`)."""
    eval_path: str | None = None
    """JSONL held-out items. Unset: the environment's own (`Environment.heldout_items`; tic-tac-toe generates
    boards disjoint from the training set)."""
    num_items: int = Field(2048, ge=1)
    """Size of the generated training set when `dataset_path` is unset (environments that generate items)."""
    num_eval_items: int = Field(256, ge=0)
    """Size of the generated held-out set when `eval_path` is unset (environments that generate items)."""
    seed: int = 2026
    """Seed of the generated datasets (the same seed gives the same files)."""
    shuffle: bool = True
    """Visit items in a seeded random order, reshuffled every epoch."""
    signal_replay: float = Field(0.0, ge=0.0, le=0.5)
    """Per-board curriculum: this share of each batch's boards (rounded down, so with `rollout.batch_size` 4 set it
    to >= 0.25) is drawn first from a queue of boards whose last group had a learning signal (rewards that
    differ), oldest first; the rest follow the seeded order. A board whose group has settled (one reward) is not
    queued again, so what the policy has settled fades and what it still gets wrong comes back. 0 = off. The queue
    is saved with the data cursor (rlsys/data.py)."""


class RolloutConfig(_Section):
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """Generation engine: `auto` = vLLM when CUDA and vLLM are there, transformers otherwise."""
    batch_size: int = Field(4, ge=1)
    """Dataset items (prompts, boards) per step."""
    n_samples: int = Field(4, ge=1)
    """Trajectories sampled per item; advantages are normalised within each item's group."""
    max_new_tokens: int = Field(64, ge=1)
    """Default and cap for tokens generated per turn (the proxy refuses larger `max_tokens`)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature applied by the proxy; logprobs are always those of the raw distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold applied by the proxy."""
    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion the engine accepts."""
    engine_max_batch: int = Field(64, ge=1)
    """Most concurrent sequences the transformers engine batches together."""
    engine_threads: int | None = Field(1, ge=1)
    """Torch threads of the transformers engine's forward passes (None: the rollout actor's, every core on CPU).
    1 because on the shared 2-core box a second thread that waits for a core stalls the first at every op: one
    64-sample recipe step took 1.31 s median (0.47-2.46) with 2 threads against 0.58 s (0.51-0.78) with 1 while
    other jobs ran; inside the recipe job the two were equal within noise (rollout 1.11 vs 1.18 s at load ~6).
    Not compared on an idle box, where 2 threads may be faster (docs/results-cpu.md)."""
    drop_rollout_state: bool = False
    """After rollout, sleep the engine at level 2 (drop weights and KV cache; the push restores them)
    instead of level 1 (offload weights, drop KV cache)."""
    overlap: bool = False
    """Sample the next step's batch while the learner trains on this one (one step off-policy, as verl's and
    AReaL's asynchronous modes): a step takes about the longer of rollout and update instead of their sum. The
    batch a step trains on was sampled with the weights of before the previous update; the losses weigh it by its
    sampling logprobs (`algo.logp_mode`). The engines stay awake (sleep level 0: not with `keep_awake = false` or
    `drop_rollout_state`); each push waits for the rollout in flight. `rollout/off_policy_steps` is 1 on a step
    whose batch was sampled ahead, `time/rollout_sampling` its rollout's own time (`time/rollout` is then the wait
    for it). A checkpoint holds the data cursor of before the rollout in flight: a resumed job samples it again."""
    keep_awake: bool | Literal["auto"] = "auto"
    """Skip the engine's sleep between rollout and training (and the wake after the push): vLLM keeps its weights
    and KV cache while the learner trains, and the push writes into the awake weights. On an H200 (0.5B model,
    64 x 64 tokens) the step's non-compute share went 7.7% -> 4.1% (docs/performance.md). `auto`: awake on a GPU
    where vLLM's share and the learner's estimated peak (rlsys/memory.py) fit side by side within 90% of the
    device, as they always do under `gpu_memory_budget_gib` (which caps both); else sleep (level 1, or 2 with
    `drop_rollout_state`). On CPU `auto` sleeps (nothing to free there)."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs / torch.compile (fast start, slower steady state)."""
    graph_mode: Literal["compile", "full_decode"] = "compile"
    """vLLM without `enforce_eager`: `compile` = vLLM's default (torch.compile of the model, piecewise CUDA graphs
    for prefill and mixed batches, full graphs for decode; on a fresh H200 the first sample of the Qwen 0.5B job came
    112 s after the process started, against 46 s eager with the V1 runner: docs/results.md, 2026-12-03); `full_decode` = no
    torch.compile, full CUDA graphs of decode batches only (prefill and mixed batches run eager), which skips the
    compile. Either way graphs are captured for batch sizes up to `engine_max_batch` only, and vLLM's, Triton's and
    Inductor's caches live under ${RLSYS_CACHE:-~/.cache/rlsys}/compile, so a second start on a machine reuses them."""
    engine_process: Literal["forkserver", "spawn"] = "forkserver"
    """vLLM: how the engine-core process starts inside the rollout actor. `forkserver`: a fork server started
    before the actor imports vLLM imports torch and vLLM meanwhile, and the engine core is forked from it
    (rlsys/engines/vllm_engine.py). `spawn`: vLLM's own way in a Ray actor, a fresh interpreter that imports them
    again after the actor did (~15 s more of an eager start on an H200; docs/performance.md, section 5)."""
    model_runner: Literal["auto", "v1", "v2"] = "auto"
    """vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER in the engine's processes): `auto` = vLLM's choice (V2 for
    Qwen2 and most text models in vLLM 0.26), `v1`, `v2`. V2 JIT-compiles 15-20 s of Triton kernels (input
    preparation, sampling, logprobs) at the first start on a machine, while ~/.triton is empty; V1 almost none. With
    `enforce_eager`, `v1` is the fast-start setting (a fresh H200: first sampled token 45.6 s). Its steady-state cost,
    measured once each on an H200: none in the step benchmark (3660 vs 3363 tokens/s), but the proxy benchmark's
    agent path at 128 requests in flight reached 0.77 of direct generation against 0.86-1.09 with V2
    (docs/performance.md, sections 2 and 5)."""
    executor: Literal["auto", "ray"] = "auto"
    """vLLM's workers: `auto` = in the rollout actor's engine process with `cluster.tp_size` 1, Ray actors in the
    job's placement group (vLLM's Ray executor, one worker per GPU bundle of the engine) with tp_size > 1.
    `ray` also takes the Ray executor at tp_size 1 (the tensor-parallel path on one GPU)."""
    gpu_memory_budget_gib: float | None = Field(None, gt=0)
    """GPU memory of the whole co-located job in GiB (vLLM weights + KV cache, learner weights, gradients,
    optimizer states, activations). Checked before Ray starts against an estimate (rlsys/memory.py; refused,
    with settings that fit, when over); the learner's allocator is capped at its share and vLLM sized from the
    rest. Unset: no check, vLLM takes a third of the device and the learner the rest."""
    budget_prompt_tokens: int | None = Field(None, ge=1)
    """The prompt length in tokens that the estimate behind `gpu_memory_budget_gib` assumes (with
    `learner.prefix_sharing` a group's prompt runs through the learner once, so a short prompt is a much smaller
    learner). Unset: `rlsys train` measures it before Ray starts, as `rlsys tune` does (the longest of the first
    64 training items' first requests, in the model's tokens, where the environment gives its first request) and
    the run's config.resolved.toml records it; where it cannot be measured (multi-turn, SFT) sequences are
    assumed `max_model_len` long, the worst case. Set it for prompts longer than those the measure sees."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """vLLM: a fixed KV cache of this many GiB (vLLM's `kv_cache_memory_bytes`) instead of sizing it by
    profiling at start-up. The profile assumes no other process changes its GPU memory meanwhile; set this
    when several jobs share one GPU (a learning-rate sweep), where another job's sleep/wake breaks it. The memory
    estimate counts this size as the engine's KV cache, and a size that cannot hold one `max_model_len` sequence of
    the model is refused before Ray starts (`rlsys train`'s preflight, `rlsys tune`), not by vLLM minutes later."""


AUTO_WORKERS_PER_NODE = (2, 8)  # `env.num_workers = "auto"`: half a node's CPUs, clamped to this range


class EnvConfig(_Section):
    name: str = "tictactoe"
    """The environment (rlsys/envs/base.py `Environment`): a built-in one (`tictactoe`, `tictactoe_game`, `ledger`,
    `gsm`, `mcp_calculator`) or a user's, `package.module:ENV` or `path/to/file.py:ENV` (docs/CONTRACTS.md)."""
    agent_fn: str | None = None
    """Replaces the environment's agent: `path/to/file.py[:name]` or `package.module:name`;
    `async def agent(item, client, model)`. Unset: the environment's own."""
    reward_fn_path: str | None = None
    """Replaces the environment's reward: `path/to/file.py[:name]` or `package.module:name`;
    `def reward(record) -> float`, with the file's optional `outcome`, `OUTCOMES`, `validate_item`, `summarize`.
    Unset: the environment's own."""
    num_workers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Env worker actors (CPU); each runs many agents concurrently. `auto`: half the CPUs of each engine's node,
    2 to 8 per node. Each worker's event loop runs its agents' OpenAI clients one request at a time (~2-4 ms
    of CPU a request), so with 2 workers x 64 episodes the last request of a step reached the engine up to
    ~1 s after the first (2-core box; docs/performance.md, section 2)."""
    max_concurrency: int = Field(64, ge=1)
    """Concurrent agent episodes per env worker."""
    agent_timeout_s: float = Field(120.0, gt=0)
    """An agent episode running longer is cancelled and its trajectory marked failed."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """A reward call running longer is abandoned and its trajectory marked failed."""
    max_failed_frac: float = Field(0.5, ge=0.0, le=1.0)
    """A step where more than this fraction of trajectories failed is not trained on (logged, skipped)."""
    retry_failed_worker: bool = True
    """Retry once the trajectories of an env worker that died mid-step (Ray restarts the worker)."""

    def worker_count(self, node_cpus: list[float]) -> int:
        """Env workers for engines on nodes with these CPU counts (one entry per distinct node; 0 = unknown,
        counted as 4): `num_workers`, or for `auto` half of each node's CPUs within AUTO_WORKERS_PER_NODE."""
        if self.num_workers != "auto":
            return self.num_workers
        low, high = AUTO_WORKERS_PER_NODE
        return sum(min(high, max(low, int(c or 4) // 2)) for c in node_cpus or [0.0])

    def environment(self) -> Any:
        """The `rlsys.envs.Environment` these settings name, with the agent/reward plug-ins laid over it
        (PluginError if one cannot be loaded)."""
        from rlsys.envs.base import resolve_environment

        return resolve_environment(self.name, self.agent_fn, self.reward_fn_path)


class AlgoConfig(_Section):
    name: Literal["gspo", "grpo", "sft"] = "gspo"
    """Loss: GSPO (sequence-level ratio), GRPO (token-level ratio), or SFT (masked cross-entropy)."""
    clip_eps_low: float | None = Field(None, ge=0.0)
    """Lower clip of the ratio; unset = 3e-4 for GSPO, 0.2 for GRPO."""
    clip_eps_high: float | None = Field(None, ge=0.0)
    """Upper clip of the ratio; unset = 4e-4 for GSPO, 0.28 for GRPO."""
    logp_mode: Literal["bypass", "decoupled"] = "bypass"
    """`bypass`: logp_old = the engine's sampling logprobs. `decoupled`: the learner's own logprobs before the
    update, with a truncated importance weight against the engine's (cap `tis_cap`): recomputed in a forward before
    the first optimizer step when `n_minibatches` > 1; with one, the update's own forward, detached."""
    tis_cap: float = Field(2.0, gt=0.0)
    """Cap of the truncated sequence importance weight in `decoupled` mode."""
    adv_eps: float = Field(1e-6, gt=0.0)
    """Added to the group std when normalising advantages."""
    scale_advantages: bool = True
    """GSPO/GRPO: divide each group's reward deviations by the group's std (GRPO, GSPO as published; TRL's
    `scale_rewards="group"`). False: the deviations as they are (Dr. GRPO; TRL's `scale_rewards="none"`), so a
    group whose answers nearly agree (one weaker move in eight) is not pushed with advantages ~2.5 times its
    reward gap (rlsys/algos/advantages.py)."""
    positive_weight: float = Field(1.0, ge=0.0, le=1.0)
    """GSPO/GRPO: weight of the positive advantages (W-REINFORCE, Zhu et al. 2025: 0.1; 0 = negative samples
    only). Reinforcing the answers a policy already prefers is what collapses its entropy; pushing the worse ones
    down spreads their mass over the rest. 1 = off (rlsys/algos/advantages.py)."""
    mask_truncated: bool = False
    """Leave trajectories with a turn cut at `max_new_tokens` out of the advantages and the loss (TRL's
    `mask_truncated_completions`, DAPO's overlong filtering), so that a cut-off answer whose opening still
    scores is not reinforced into ever longer answers. Counted in `adv/truncated_masked_frac`."""
    truncated_penalty: float = Field(0.0, ge=0.0)
    """Subtracted from the reward of a trajectory with a turn cut at `max_new_tokens`, in its group's advantages and
    in dynamic sampling's filter; the logged rewards and the evals stay the environment's (DAPO's overlong
    punishment, in its hard form). The alternative to `mask_truncated` where masking leaves nothing to learn from:
    once nearly every answer runs on to the cut, masked answers carry no signal that would shorten them, penalised
    ones do (a Qwen 0.5B full fine-tune froze that way, docs/results.md). 0 = off; exclusive with mask_truncated.
    Counted in `adv/truncated_penalized_frac`."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """GSPO/GRPO: entropy bonus, `loss -= entropy_coef * mean token entropy` over the sampled tokens (verl's
    `entropy_coeff`; rlsys/algos/regularizers.py). 0 = none. The entropy itself is logged every step either way
    (`train/entropy`). Set, every sequence runs through the learner (not only those with an advantage)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """GSPO/GRPO: KL penalty to a frozen reference policy, `loss += kl_coef * mean k3(ref, policy)` over the sampled
    tokens (TRL's `beta`, verl's `kl_loss_coef` with `low_var_kl`), logged as `train/kl_ref`. The reference is the
    initial model (`model.ckpt`, also after a resume), loaded by the learner in the compute dtype, frozen; it costs
    one more copy of the weights (counted in the memory estimate) and a no-grad forward per micro-batch. Set, every
    sequence runs through the learner. 0 = off, no reference loaded."""
    kl_decay: tuple[int, int, float] | None = None
    """With `kl_coef`: `[start, end, final]`, the penalty's coefficient stays `kl_coef` until optimizer step `start`,
    goes linearly to `final` at step `end`, then stays there (resumes follow the step count). The penalty holds the
    policy near the reference while the first rewards could lock it onto one answer; once it reads the task the same
    penalty pulls it back towards the reference's answers (docs/usage.md, docs/results-cpu.md 2026-12-06). The
    coefficient a batch applied is logged as `train/kl_coef`; `train/kl_ref` is measured at any coefficient, 0
    included. None: `kl_coef` throughout."""
    entropy_target: float | None = Field(None, gt=0.0)
    """GSPO/GRPO: adaptive entropy control (Skywork-OR1, He et al. 2025; rlsys/algos/regularizers.py
    `EntropyController`): the entropy bonus's coefficient follows the policy's entropy instead of staying fixed, since
    what a fixed `entropy_coef` does depends on the model, the data and the stage of training (too little, or an
    entropy that blows up). After each rollout batch with
    `train/entropy` e: `coef = min(entropy_coef_max, coef + entropy_coef_step)` if e < target, else
    `max(0, coef - entropy_coef_step)`; the next batch applies `coef` if e < target, else no bonus at all (the
    entropy loss acts only while the entropy is below the target). `entropy_coef` is then the starting coefficient,
    applied to the first batch. The coefficient a batch applied is logged as `train/entropy_coef`, and kept in
    checkpoints. With `top_entropy_frac` the entropy compared is the selected tokens' mean, as `train/entropy` is.
    A batch without a finite entropy changes nothing. While a bonus is applied every sequence runs through the
    learner, otherwise only those with an advantage. None: off (a fixed `entropy_coef`)."""
    entropy_coef_step: float = Field(0.005, gt=0.0)
    """With `entropy_target`: how much the coefficient moves per rollout batch (Skywork-OR1's Delta)."""
    entropy_coef_max: float = Field(0.1, gt=0.0)
    """With `entropy_target`: the coefficient's ceiling (>= `entropy_coef`), so a target the policy cannot reach
    does not grow the bonus without bound."""
    n_minibatches: int = Field(1, ge=1)
    """Optimizer steps per rollout batch; with 1, the GSPO ratio is 1 and GSPO is sequence REINFORCE."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl's `algorithm.filter_groups.enable`): drop the groups whose valid rewards all
    agree (no advantage, no signal) and sample more boards in the same rollout phase until `rollout.batch_size`
    groups with signal or `max_sample_rounds` rounds; the step trains on the kept groups (fewer if the cap was hit,
    none: the update is skipped). Counted in `rollout/groups_sampled`, `groups_kept`, `zero_var_group_frac`
    (before the filter) and `sample_rounds` (rlsys/sampling.py)."""
    max_sample_rounds: int = Field(3, ge=1)
    """Cap of dynamic sampling (verl's `filter_groups.max_num_gen_batches`, but here reaching it trains on what was
    kept instead of raising): rounds of sampling per step, the first included; 1 = filter only. With
    `max_oversample` F a step samples at most `batch_size x F x max_sample_rounds` boards."""
    max_oversample: float = Field(4.0, ge=1.0)
    """Dynamic sampling's round sizes, at most this many boards per group wanted: the first round samples
    `batch_size` / (the recent share of groups with signal, `rollout/signal_rate`) boards, a top-up round (missing
    groups / keep rate so far this step), each all at once (a top-up's size too when nothing was kept yet)."""
    unanimous_baseline: Literal["none", "batch", "batch_below"] = "none"
    """GSPO/GRPO: the advantage of a *unanimous* group, one whose valid rewards all agree. `none`: 0, the group
    teaches nothing (GRPO/GSPO as published). `batch`: its members' reward less the mean of the batch's valid
    rewards, over their std (REINFORCE++'s batch baseline; action-independent, so unbiased), so a board the policy
    answers the same way every time is still pushed: down when that answer scores below the batch, up when above.
    `batch_below`: the same, but only down (a positive batch advantage becomes 0), and `unanimous_groups` takes the
    lowest-scoring unanimous groups first: raising an answer the policy already gives every time mostly sharpens it
    (docs/usage.md: in the GPU recipe a unanimous 0.8, a slower win where an immediate one was on the board, sat above
    the batch mean and was raised), while pushing down one it gives every time and that scores below the batch moves
    mass to the other answers of that board. Measured on the GPU recipe with 4 groups: all four runs collapsed by
    step 99-190 (half of each batch pushed down only; the answers ran on to the cut; docs/results.md, 2026-12-06).
    Groups with signal keep their own baseline. Counted in `adv/unanimous_frac`. Under `dynamic_sampling` the
    filter drops unanimous groups: `unanimous_groups` brings some into the batch."""
    unanimous_groups: int = Field(0, ge=0)
    """Under `dynamic_sampling` with `unanimous_baseline = "batch"` (or `"batch_below"`): up to this many of the
    step's unanimous groups (with a valid member; in sampling order, or lowest reward first under `batch_below`) join
    the `rollout.batch_size` groups with signal. They were sampled anyway: no extra sampling, only learner time.
    Counted in `rollout/groups_unanimous_kept`."""
    collapse_steps: int = Field(20, ge=0)
    """GSPO/GRPO: the policy has collapsed when every group of a step is unanimous (`rollout/zero_var_group_frac`
    1: every board answered with one reward, no advantage anywhere, nothing to learn) this many steps in a row, or
    on `collapse_share` of the last twice this many steps; the job then says so once, with the settings that keep
    groups apart. 0: never. `rollout/unanimous_streak` counts the current run of such steps, `rollout/unanimous_steps`
    those of the last 2 x `collapse_steps`."""
    collapse_share: float = Field(0.8, gt=0.0, le=1.0)
    """The share of the last 2 x `collapse_steps` steps (rounded up: 32 of 40) that also declares the collapse; 1 =
    the streak alone. A frozen policy still finds a group with signal on the odd step: a GPU run stuck on "the first
    free square" had 127 all-unanimous steps of 188 but 20 in a row only at step 209, where 32 of 40 stops it at
    step 58. A run that recovered from 19 such steps in a row (entropy control over all tokens, seed 0: held-out
    optimal 0.848) had at most 26 of any 40, the other runs of 2026-12-06 that did not collapse 0-17, the CPU main
    job's four seeds none (docs/results.md, twenty-ninth session)."""
    stop_on_collapse: bool = False
    """End training when the collapse above is declared (the end eval and the final checkpoint, as at
    `max_steps`): a collapsed run trains on nothing, and under `dynamic_sampling` each of its steps still samples
    `max_sample_rounds` rounds (5 s a step of the GPU recipe, 2026-12-05)."""
    top_entropy_frac: float | None = Field(None, gt=0.0, le=1.0)
    """GSPO/GRPO: the loss (policy term, KL penalty and entropy bonus alike) on the sampled tokens whose policy
    entropy is in the top fraction of each micro-batch's sampled tokens, the others masked out ("Beyond the 80/20
    rule", Wang et al. 2025: the high-entropy "forking" tokens carry the learning; they kept 20%). The regularizers'
    token mean (and GRPO's) then runs over about `fraction` x the sampled tokens, so the terms weigh against each
    other as they do without the option. For answers that are mostly fixed format around one decision (the tic-tac-toe call:
    ~19 format tokens and a square) the update goes to the decision instead of the format (docs/results-cpu.md).
    `train/entropy` and `train/kl_ref` are then the selected tokens' means. None: every sampled token."""

    @model_validator(mode="after")
    def _regularizers_need_a_policy_loss(self) -> AlgoConfig:
        if self.name == "sft" and (self.entropy_coef or self.kl_coef):
            raise ValueError("algo.entropy_coef / algo.kl_coef: GSPO/GRPO only (SFT's loss takes no regularizer)")
        if self.kl_decay is not None:
            start, end, final = self.kl_decay
            if not self.kl_coef:
                raise ValueError("algo.kl_decay: decays algo.kl_coef, which is 0 (no penalty, no reference): set kl_coef")
            if not 0 <= start < end or final < 0.0:
                raise ValueError(f"algo.kl_decay = {list(self.kl_decay)}: want [start, end, final] with 0 <= start < end "
                                 "(optimizer steps) and final >= 0")
        if self.name == "sft" and self.entropy_target is not None:
            raise ValueError("algo.entropy_target: GSPO/GRPO only (SFT's loss takes no regularizer)")
        if self.entropy_target is not None and self.entropy_coef_max < self.entropy_coef:
            raise ValueError(f"algo.entropy_coef_max = {self.entropy_coef_max} is below algo.entropy_coef = "
                             f"{self.entropy_coef}, the starting coefficient of algo.entropy_target's control: "
                             "raise entropy_coef_max or lower entropy_coef")
        if self.name == "sft" and self.top_entropy_frac is not None:
            raise ValueError("algo.top_entropy_frac: GSPO/GRPO only (SFT trains on every target token)")
        if self.name == "sft" and (self.positive_weight != 1.0 or not self.scale_advantages):
            raise ValueError("algo.positive_weight / algo.scale_advantages: GSPO/GRPO only (SFT has no advantages)")
        if self.name == "sft" and self.unanimous_baseline != "none":
            raise ValueError("algo.unanimous_baseline: GSPO/GRPO only (SFT has no groups)")
        if self.unanimous_groups and not (self.dynamic_sampling and self.unanimous_baseline != "none"):
            raise ValueError(f"algo.unanimous_groups = {self.unanimous_groups}: brings unanimous groups past dynamic "
                             "sampling's filter for the batch baseline; set algo.dynamic_sampling = true and "
                             "algo.unanimous_baseline = \"batch\" or \"batch_below\" (without the filter every "
                             "group is trained on)")
        return self

    def clip_eps(self) -> tuple[float, float]:
        defaults = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.28), "sft": (0.0, 0.0)}[self.name]
        low = defaults[0] if self.clip_eps_low is None else self.clip_eps_low
        high = defaults[1] if self.clip_eps_high is None else self.clip_eps_high
        return low, high


LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    enabled: bool = False
    """Train low-rank adapters (peft's LoRA) on a frozen base instead of every weight: only the adapters get
    gradients and optimizer states, a push carries only them, and the engine serves the base with the adapter
    merged in, W = W_base + (alpha / rank) B A, from a kept copy of the targets' base weights (rlsys/lora.py).
    Checkpoints hold the adapter in peft's format; `rlsys export --merge` writes a merged model folder."""
    rank: int = Field(16, ge=1, le=1024)
    """The adapters' rank r (A is r x in, B is out x r)."""
    alpha: float = Field(32.0, gt=0.0)
    """LoRA's alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (the engine and the canary run without it)."""
    target_modules: list[str] = list(LORA_ALL_LINEAR)
    """Names of the linear layers that get an adapter (the last part of the module name, as in peft): by default
    every projection of a Qwen2/Llama block. The engine keeps a copy of these layers' base weights (the memory
    estimate counts it): `["q_proj", "v_proj"]` keeps ~1/18 of a 7B model's weights (0.77 GiB), all of them 6/7."""
    serve: Literal["merged", "adapter"] = "merged"
    """How the engine applies a pushed adapter. `merged`: written into the engine's own weights, W = W_base +
    (alpha / rank) B A, from a kept copy of the targets' base (rlsys/lora.py `LoraMerge`; any engine, no LoRA
    kernels when decoding; a push rewrites every targeted weight: 29.7 ms for a 7B model with every projection
    targeted, docs/gpu.md). `adapter`: vLLM serves the base plus the adapter through its own LoRA layers (one GPU
    slot, rank rounded up to vLLM's next allowed `max_lora_rank`); a push copies A and scale x B into the slot
    (`LoraSlots`): no kept copy, the base never written, but vLLM's LoRA kernels in every forward. vLLM only. On a
    7B shape with every projection targeted (one H100): push 19.7 ms against 34.9 merged, no 12.2 GiB kept copy,
    and with a 4-bit learner base a GSPO step in 23.9 GiB (docs/gpu.md); its decode cost in the 0.5B job is not
    measured yet, so `merged` stays the default."""
    base_4bit: bool = False
    """Load the learner's frozen base in 4-bit NF4 (bitsandbytes, needs CUDA; bf16 compute): about a quarter of the
    base's memory. The engine still serves the bf16 base, so the learner's logprobs differ from the engine's by the
    quantization error: the canary's default tolerance is then 0.5 (a first guess; `train/logp_diff_mean` and
    tests/gpu/test_lora_gpu.py measure the mismatch; `sync.canary_tol` overrides it)."""

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, targets: list[str]) -> list[str]:
        if not targets:
            raise ValueError("empty: name at least one linear layer, e.g. [\"q_proj\", \"v_proj\"]")
        bad = [t for t in targets if not t or not t.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"{bad}: module names are identifiers (the last part of a name, like q_proj)")
        if len(set(targets)) != len(targets):
            raise ValueError(f"a module is named twice: {targets}")
        return targets

    def scale(self) -> float:
        """The adapters' update scale, alpha / rank."""
        return self.alpha / self.rank


class LearnerConfig(_Section):
    lr: float = Field(1e-5, gt=0.0)
    """Peak learning rate."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up, over `max_steps` optimizer steps."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up optimizer steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_8bit: bool = False
    """bitsandbytes AdamW8bit (needs CUDA and bitsandbytes; refused otherwise)."""
    fp32_master: bool = False
    """Keep the learner's weights (and so every optimizer update) in float32 and compute under bf16/fp16
    autocast when `model.dtype` is 16-bit; pushes are cast to the engine's dtype. In bf16 an update smaller
    than half a unit in the last place is rounded away (1e-5 on a weight of 0.02, whose ulp is 1.2e-4), so
    small learning rates barely move bf16 weights."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping; a non-finite norm skips the optimizer step."""
    mini_bs: int = Field(4, ge=1)
    """Micro-batch size (trajectories per forward/backward); gradients accumulate over micro-batches."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Cut micro-batches by size instead of by count (verl's dynamic batch size): consecutive rows, in the learner's
    order (a prompt's rows together, shorter first), share a micro-batch while rows x its longest row stays within
    this many padded positions; a longer row runs alone. None: `mini_bs` rows each. Fewer, fuller forwards where a
    micro-batch's fixed cost (kernel launches, Python) outweighs its tokens' arithmetic; the learner's peak memory
    follows this budget instead of `mini_bs` times the longest rows. Same gradient either way (the loss normaliser
    is the minibatch's); `train/micro_batches` counts them."""
    prefix_sharing: bool = True
    """GSPO/GRPO: run the prompt that the samples of a micro-batch share forward once and their answers on its KV
    cache (`rlsys/prefix.py`; same logprobs and gradients, ~6x fewer tokens on tic-tac-toe). Sequences whose
    prompt no other one has, SFT, and models under gradient checkpointing take the plain full-sequence forward.
    It costs two passes through the layers a micro-batch instead of one: where the learner is bound by its host
    rather than its arithmetic, that cost can outweigh the tokens saved (`scripts/learner_dispatch_probe.py`)."""
    common_prefix_pass: bool | None = None
    """With `prefix_sharing`: where the shared prompts of a micro-batch's groups open alike (the system prompt and
    tool schema of every tic-tac-toe board, ~210 of ~234 tokens), run that common part once before them, its cache
    gathered onto the groups (`rlsys.prefix.common_prefix_length`; same logprobs and gradients). One more pass a
    micro-batch for (groups - 1) x its tokens fewer. None: on for a CPU learner (the README job's learner 0.38 ->
    0.35 s a step, docs/performance.md section 7), off on CUDA, where it has not been measured and a pass's fixed
    cost can outweigh the tokens (`prefix_sharing` above)."""
    length_order: bool = True
    """Within the rows of one prompt, shorter first before they are cut into micro-batches of `mini_bs` (the
    prompts' order and the gradients stay the same): a micro-batch is as long as its longest row, so short answers
    no longer pad to long ones (`train/padded_frac`; `python -m jobs.bench learner` measures both orders). False:
    the rows of a prompt in their sampled order, as before 2026-12-04."""
    cudnn_attention: bool = False
    """Let the learner's attention (PyTorch's scaled_dot_product_attention) pick the cuDNN kernel on CUDA. Off by
    default: with torch 2.11 on an H200, cuDNN's backward returns NaN gradients for a masked micro-batch whose
    length is 64 mod 128 when a row's attention logsumexp is below ln(float32 max), as in Qwen2.5's
    massive-activation heads (pytorch/pytorch#196678): 9 of 63 gsm steps were skipped for a non-finite gradient
    norm (docs/results.md). Off, the same calls take the flash or memory-efficient kernels."""
    empty_cache: bool = False
    """On a GPU, after each `train` call, hand the blocks PyTorch's caching allocator keeps but no tensor uses back
    to the device (`torch.cuda.empty_cache()`, as verl does after its actor update): between updates the learner
    then holds its weights, optimizer state and push buffers, not its last step's reserve. For several jobs on one
    GPU, or an engine that wakes beside the learner: one H100 run of the Qwen 0.5B recipe held 29.8 GiB reserved
    for a 17.3 GiB allocated peak, and a fourth job beside three died of CUDA out of memory (docs/results.md,
    2026-12-06). The next step allocates again (`cudaMalloc`). `mem/learner_reserved_gib` logs what the learner
    holds after the call either way. No effect on CPU. Off by default; configs/tictactoe-qwen0.5b.toml sets it (its
    three runs sharing an H100 held 1.6 GiB between updates, at no measured cost in the train phase, 2026-12-06)."""
    lora: LoraConfig = LoraConfig()
    """Low-rank adapters on a frozen base (`learner.lora.enabled`); off by default."""


class SyncConfig(_Section):
    transport: Literal["auto", "cuda_ipc", "collective", "object_store"] = "auto"
    """How weights reach each engine from its learner rank. `auto`, chosen per engine by where both landed:
    `cuda_ipc` when they share a GPU, `collective` (one NCCL broadcast per bucket over a group of the learner
    rank and its engines) when both are on GPUs but not the same one (another GPU or node), `object_store`
    (bytes through Ray) on CPU. `collective` on CPU broadcasts with gloo. The choice is logged per engine."""
    bucket_mb: int = Field(512, ge=1)
    """Size of the reusable buffers weights are packed into (one handle and one RPC per bucket)."""
    canary: bool = True
    """After every push, compare the engine's and the learner's logprobs on a fixed sequence."""
    canary_tol: float | None = Field(None, gt=0.0)
    """Largest allowed mean |logprob difference|; unset = 1e-4 in float32, 2e-2 in bf16."""
    canary_every: int = Field(1, ge=1)
    """Run the canary after every N-th push only (it cost 6.6% of a 1 s Qwen 0.5B step on an H200, and 56-64 ms
    against a 20-34 ms push); the check when the job starts always runs, and so does every push that `fingerprint`
    could not check. 1 = every push, the default; with the fingerprint on, N > 1 still catches a skipped or partly
    lost push on its step, and the canary every N-th checks the numerics the bits cannot."""
    fingerprint: bool = True
    """After every push, compare exact bit sums of every pushed tensor: the learner's over what it sent, each
    engine's over what the push wrote (rlsys/weights/fingerprint.py). Catches a skipped or partial push on the
    step it happens, whatever the numerics (fp32 masters, LoRA), in a few milliseconds. An engine that cannot tell
    (vLLM before its first push builds the copy plan, tensor parallel) gets the canary for that push instead."""


class ClusterConfig(_Section):
    address: str | None = None
    """Ray cluster address; unset = `RAY_ADDRESS` if set, else an embedded local Ray."""
    namespace: str | None = None
    """Ray namespace of this job's named actors; unset = derived from the run directory name."""
    world_size: int = Field(1, ge=1)
    """GPUs used (one bundle each); 1 = learner and engine co-located on one GPU."""
    tp_size: int = Field(1, ge=1)
    """GPUs per vLLM engine (tensor parallel)."""
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "STRICT_PACK"
    """Ray placement-group strategy for the GPU bundles."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of an embedded local Ray (unset = all)."""
    cpus_per_bundle: int = Field(1, ge=0)
    """CPUs reserved with each GPU bundle."""
    prefetch: bool | Literal["auto"] = False
    """Read torch's, vLLM's, Ray's and the CUDA libraries' files (and a local model's) into the page cache on 8
    threads as the job starts, before anything imports them (rlsys/prefetch.py; `auto`: on a machine with an
    NVIDIA GPU). Off by default: on an H200 it read 5.65 GiB in 5-10 s and no start-up measured faster for it
    (53.4 s without, 58.3 s with, page cache dropped; docs/performance.md, section 5)."""


class EvalConfig(_Section):
    at_start: bool = False
    """Evaluate on the held-out items before the first step."""
    at_end: bool = False
    """Evaluate on the held-out items after the last step."""
    every: int = Field(0, ge=0)
    """Also evaluate every N steps (0 = never)."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of evaluation episodes (0 = greedy)."""
    n_samples: int = Field(1, ge=1)
    """Episodes per held-out item."""
    perturb: bool = False
    """Also run the held-out items under each of the environment's perturbations (`Environment.perturbations`:
    tic-tac-toe's prompt variants, gsm's changed numbers / names / reordered question, ...), each variant on the
    items it applies to; logged as `eval/<variant>/...`."""


class LoggingConfig(_Section):
    metrics_log_dir: str | None = None
    """TensorBoard event directory; unset = `<run_dir>/tb`."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    progress: bool = True
    """Show a progress bar during rollout."""
    trackers: list[Literal["wandb", "mlflow"]] = []
    """Experiment trackers beside TensorBoard (TRL's `report_to`), e.g. `["wandb", "mlflow"]`: each gets the
    metrics under TensorBoard's names and the resolved config as parameters (dotted keys); see rlsys/trackers.py."""
    run_name: str = ""
    """The run's name in the trackers; unset = the run directory's name."""
    wandb_project: str = "rlsys"
    """W&B project."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """`offline`: W&B writes its run files under `<run_dir>/wandb/` only, for `wandb sync` to upload later;
    `online` streams to the W&B server (needs `wandb login`)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI (a server `http://...`, `sqlite:///...`, `databricks`); unset = a SQLite store
    `<run_dir>/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`)."""
    mlflow_experiment: str = "rlsys"
    """MLflow experiment the run goes into (created if missing)."""

    @field_validator("trackers")
    @classmethod
    def _trackers_installed(cls, trackers: list[str]) -> list[str]:
        import importlib.util

        from rlsys.trackers import TRACKER_PACKAGES

        if len(set(trackers)) != len(trackers):
            raise ValueError(f"a tracker is named twice: {trackers}")
        for name in trackers:
            module, install = TRACKER_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ValueError(f"tracker {name!r} needs the {module} package, which is not installed: {install}")
        return trackers


class CheckpointConfig(_Section):
    save_path: str | None = None
    """Checkpoint directory; unset = `<run_dir>/checkpoints`."""
    save_interval: int = Field(0, ge=0)
    """Save every N steps (0 = only at the end of the run)."""
    keep: int = Field(3, ge=1)
    """How many step checkpoints to keep (oldest removed first)."""
    resume: str = "never"
    """`never`, `auto` (the latest complete checkpoint under `save_path`, if any) or a checkpoint path."""


class Config(_Section):
    max_steps: int = Field(20, ge=1)
    """Training steps (one rollout batch and `algo.n_minibatches` optimizer steps each)."""
    max_train_minutes: float | None = Field(None, gt=0)
    """A time box: no step starts once this many minutes have passed since the process started (start-up and
    evaluations included); the job then evaluates at the end and checkpoints as after `max_steps`. Unset: none."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    run_dir: str = ""
    """Where the resolved config, metrics, TensorBoard events and checkpoints go; unset = runs/<algo>-<time>."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    env: EnvConfig = EnvConfig()
    algo: AlgoConfig = AlgoConfig()
    learner: LearnerConfig = LearnerConfig()
    sync: SyncConfig = SyncConfig()
    cluster: ClusterConfig = ClusterConfig()
    logging: LoggingConfig = LoggingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> "Config":
        r, a, c = self.rollout, self.algo, self.cluster
        if a.name in ("gspo", "grpo") and r.n_samples < 2:
            raise ValueError(f"rollout.n_samples: {a.name} needs >= 2 samples per item for a group baseline")
        if a.dynamic_sampling and a.name == "sft":
            raise ValueError("algo.dynamic_sampling: filters groups by their rewards; SFT has neither")
        total = r.batch_size * (1 if a.name == "sft" else r.n_samples)  # SFT: one example per item
        if total % a.n_minibatches:
            raise ValueError(
                f"algo.n_minibatches: {a.n_minibatches} does not divide rollout.batch_size x "
                f"rollout.n_samples = {total}"
            )
        per_minibatch = total // a.n_minibatches
        if self.learner.micro_batch_tokens is None and per_minibatch % self.learner.mini_bs:
            raise ValueError(
                f"learner.mini_bs: {self.learner.mini_bs} does not divide a minibatch of {per_minibatch} "
                f"trajectories (rollout.batch_size x rollout.n_samples / algo.n_minibatches; SFT: n_samples=1)"
            )
        if r.keep_awake is True and r.drop_rollout_state:
            raise ValueError("rollout.keep_awake: the engine never sleeps, so rollout.drop_rollout_state (sleep "
                             "level 2) cannot apply; set one of them")
        if r.overlap and (r.keep_awake is False or r.drop_rollout_state):
            raise ValueError("rollout.overlap: the engines sample while the learner trains, so they cannot sleep "
                             "between the two; leave rollout.keep_awake at auto or true and drop_rollout_state off")
        if c.world_size % c.tp_size:
            raise ValueError(f"cluster.tp_size: {c.tp_size} does not divide cluster.world_size {c.world_size}")
        if r.max_new_tokens >= r.max_model_len:
            raise ValueError(
                f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a prompt within "
                f"rollout.max_model_len {r.max_model_len}"
            )
        if self.algo.mask_truncated and self.algo.truncated_penalty:
            raise ValueError("algo.truncated_penalty: cut-off answers are either left out (algo.mask_truncated) or "
                             "penalised, not both; set one of them")
        lora = self.learner.lora
        if lora.enabled and r.drop_rollout_state:
            raise ValueError("learner.lora: a push carries only the adapter, but rollout.drop_rollout_state (sleep "
                             "level 2) drops the engine's base weights too; turn one of them off")
        if lora.enabled and self.learner.fp32_master:
            raise ValueError("learner.fp32_master: with learner.lora the frozen base never changes and the adapters "
                             "train in float32 already (peft); turn fp32_master off")
        if lora.base_4bit and not lora.enabled:
            raise ValueError("learner.lora.base_4bit: quantizes the frozen base of a LoRA run; set "
                             "learner.lora.enabled = true too")
        if lora.serve == "adapter" and lora.enabled and r.engine == "transformers":
            raise ValueError("learner.lora.serve = \"adapter\": vLLM's LoRA layers serve the adapter; the transformers "
                             "engine merges it (learner.lora.serve = \"merged\")")
        if lora.serve == "adapter" and lora.enabled and c.tp_size > 1:
            raise ValueError(f"learner.lora.serve = \"adapter\": pushes write the whole adapter into one worker's LoRA "
                             f"slot, so cluster.tp_size must be 1 (it is {c.tp_size})")
        if self.checkpoint.resume not in ("never", "auto") and not self.checkpoint.resume:
            raise ValueError("checkpoint.resume: empty; use never, auto or a checkpoint path")
        return self

    def sleep_level(self, awake_fits: bool = False) -> int:
        """The engines' sleep level between rollout and training: 0 (`rollout.keep_awake` or `overlap`, or `auto`
        where ``awake_fits``: the driver's memory check, `jobs.engine_group.choose_sleep_level`), 2
        (`rollout.drop_rollout_state`) or 1."""
        r = self.rollout
        if r.keep_awake is True or r.overlap or (r.keep_awake == "auto" and awake_fits and not r.drop_rollout_state):
            return 0
        return 2 if r.drop_rollout_state else 1

    def vllm_ray_executor(self) -> bool:
        """Whether a vLLM engine runs its workers as Ray actors in the placement group (`rollout.executor`)."""
        return self.cluster.tp_size > 1 or self.rollout.executor == "ray"

    # --- derived paths -------------------------------------------------------------------
    def tb_dir(self) -> Path:
        return Path(self.logging.metrics_log_dir or Path(self.run_dir) / "tb")

    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.save_path or Path(self.run_dir) / "checkpoints")


# --- CLI flags (AReno-compatible names) ------------------------------------------------------
# flag -> (dotted path, type); bool flags are store_true.
FLAGS: dict[str, tuple[str, type]] = {
    "--algo": ("algo.name", str),
    "--ckpt": ("model.ckpt", str),
    "--dataset-path": ("data.dataset_path", str),
    "--eval-path": ("data.eval_path", str),
    "--env": ("env.name", str),
    "--reward-fn-path": ("env.reward_fn_path", str),
    "--agent-fn": ("env.agent_fn", str),
    "--world-size": ("cluster.world_size", int),
    "--tp-size": ("cluster.tp_size", int),
    "--batch-size": ("rollout.batch_size", int),
    "--n-samples": ("rollout.n_samples", int),
    "--mini-bs": ("learner.mini_bs", int),
    "--max-new-tokens": ("rollout.max_new_tokens", int),
    "--temperature": ("rollout.temperature", float),
    "--lr": ("learner.lr", float),
    "--adam-8bit": ("learner.adam_8bit", bool),
    "--drop-rollout-state": ("rollout.drop_rollout_state", bool),
    "--keep-awake": ("rollout.keep_awake", bool),
    "--save-path": ("checkpoint.save_path", str),
    "--save-interval": ("checkpoint.save_interval", int),
    "--metrics-log-dir": ("logging.metrics_log_dir", str),
    "--max-steps": ("max_steps", int),
    "--seed": ("seed", int),
    "--run-dir": ("run_dir", str),
    "--resume": ("checkpoint.resume", str),
    "--engine": ("rollout.engine", str),
    "--gpu-memory-budget-gib": ("rollout.gpu_memory_budget_gib", float),
    "--address": ("cluster.address", str),
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add `--config`, the AReno-style flags and positional dotted overrides to ``parser``."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config file (flags and overrides win)")
    for flag, (path, typ) in FLAGS.items():
        dest = "flag:" + flag
        if typ is bool:
            parser.add_argument(flag, dest=dest, action="store_true", default=None, help=f"sets {path}")
        else:
            # parsed as text: pydantic converts and reports bad values with the field path
            parser.add_argument(flag, dest=dest, metavar=typ.__name__.upper(), help=f"sets {path}")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="dotted overrides, e.g. algo.clip_eps_low=3e-4 learner.lr=1e-6 (values parsed as TOML)",
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """Build the config from parsed ``add_config_args`` arguments."""
    flags = {flag: getattr(args, "flag:" + flag) for flag in FLAGS}
    return load_config(
        args.config,
        flags={k: v for k, v in flags.items() if v is not None},
        overrides=list(args.overrides or []),
    )


def load_config(
    path: str | Path | None = None,
    *,
    flags: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """defaults < TOML file < flags (``{"--lr": "1e-5"}``) < dotted overrides (``["algo.name=grpo"]``)."""
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        tree = read_toml(path)
        for key, _ in leaf_items(tree):
            sources[key] = f"file {path}"
    for flag, value in (flags or {}).items():
        if flag not in FLAGS:
            raise ConfigError(f"unknown flag {flag}; known: {', '.join(FLAGS)}")
        dotted = FLAGS[flag][0]
        _set_dotted(tree, dotted, value)
        sources[dotted] = f"flag {flag}={value}"
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algo.clip_eps_low=3e-4")
        key = key.strip()
        _set_dotted(tree, key, _parse_override_value(raw))
        sources[key] = f"override {item}"
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, sources)) from None
    if not cfg.run_dir:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.run_dir = str(Path("runs") / f"{cfg.algo.name}-{stamp}")
    return cfg


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {p}: invalid TOML: {err}") from None


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as TOML (None values are left out: they mean 'default')."""
    import tomli_w

    data = cfg.model_dump(mode="json", exclude_none=True)
    Path(path).write_text(tomli_w.dumps(data))


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, docstring) of every leaf field, for `--help-config`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe_fields(ann, f"{prefix}{name}.")
        else:
            rows.append((f"{prefix}{name}", repr(field.default), (field.description or "").replace("\n", " ")))
    return rows


# --- helpers ---------------------------------------------------------------------------------
def _parse_override_value(raw: str) -> Any:
    """TOML value syntax (3e-4, true, [1, 2], "text"); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def leaf_items(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """{"learner": {"lr": 3e-3}} -> [("learner.lr", 3e-3)]: every value of a nested table with its dotted path."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += leaf_items(v, f"{prefix}{k}.")
        else:
            out.append((prefix + k, v))
    return out


def _format_validation_error(err: ValidationError, sources: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "value_error":
            # our own cross-field checks already start with the field path
            msg = msg.removeprefix("Value error, ")
            field, sep, rest = msg.partition(": ")
            if sep and "." in field:
                loc, msg = field, rest
        source = sources.get(loc)
        got = "" if e["type"] in ("extra_forbidden", "value_error") else f" (got {e.get('input')!r})"
        where = f" [from {source}]" if source else ""
        lines.append(f"{loc or '<root>'}: {msg}{got}{where}")
    return "invalid config:\n  " + "\n  ".join(lines)
