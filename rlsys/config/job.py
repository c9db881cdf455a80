"""The config sections of the job around the learning (weight sync, cluster, eval, logging, checkpoints) and the whole
tree, `Config` (rlsys.config)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlsys.config.sections import DataConfig, EnvConfig, ModelConfig, RolloutConfig, _Section
from rlsys.config.training import AlgoConfig, LearnerConfig


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
        if self.learner.reference_actor and not a.kl_coef:
            raise ValueError("learner.reference_actor: runs the KL reference of algo.kl_coef, which is 0 (no penalty, "
                             "no reference); set algo.kl_coef or turn reference_actor off")
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
