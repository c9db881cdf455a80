"""The config sections of what a job runs on: the model, its data, the rollout and the environment (rlsys.config)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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
