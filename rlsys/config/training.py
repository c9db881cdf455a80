"""The config sections of how a job learns: the algorithm, LoRA and the learner (rlsys.config)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlsys.config.sections import _Section


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
    unanimous_pick: Literal["first", "lowest", "mixed"] | None = None
    """Which unanimous groups `unanimous_groups` takes; unset: `lowest` under `batch_below`, else `first`. `first`:
    in sampling order (mostly boards the policy already answers well, late in a run). `lowest`: the lowest-rewarded
    first (ties in sampling order), the confident mistakes, so under `batch` too only pushed down. `mixed`: half of
    them (rounded up) the lowest-rewarded, the rest the first sampled of the others, so each step pushes down its
    worst unanimous answers and the others are taken as under `first`. For the GPU recipe's late
    plateau: 14-21% of its sampled answers were legal but weaker moves the policy gave every time, which `first`
    reaches only by chance (docs/results.md, "Do more steps take more wins?"). Not yet measured on the GPU."""
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
        if self.unanimous_pick is not None and not self.unanimous_groups:
            raise ValueError(f"algo.unanimous_pick = {self.unanimous_pick!r}: picks among the unanimous groups that "
                             "algo.unanimous_groups brings into the batch; set algo.unanimous_groups too")
        return self

    def unanimous_order(self) -> str:
        """`unanimous_pick`, or its default for `unanimous_baseline` (`lowest` under `batch_below`, else `first`)."""
        if self.unanimous_pick is not None:
            return self.unanimous_pick
        return "lowest" if self.unanimous_baseline == "batch_below" else "first"

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
    reference_actor: bool = False
    """With `algo.kl_coef`: run the frozen KL reference in an actor of its own instead of inside the learner (as
    OpenRLHF's reference model and verl's ref worker do). Once a rollout batch is sampled the actor adds the
    reference's logprob of every token to its trajectories (`Segment.ref_logprobs`), and the learner's micro-batches
    take them instead of running the reference forward themselves. Under `rollout.overlap` that forward then runs
    beside the learner's update, on the engine's threads, while the engine waits for the next batch: the README job's
    learner spent ~24% of its CPU step on it (docs/performance.md). CPU jobs only for now (a GPU layout would need a
    share of a GPU for it); the reference is `model.ckpt` in the compute dtype either way, on the same
    prefix-sharing path as the learner's. False: the learner loads and runs it."""
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
