"""TRL's GRPOTrainer doing rlsys's tic-tac-toe GSPO work, for the side-by-side of issue 25 (docs/peers.md).

    python3 scripts/peers/trl_gspo.py --model /path/to/qwen-folder --out /tmp/peers/trl          # GPU, 100 steps
    python scripts/peers/trl_gspo.py --model $(rlsys tiny folder) --out /tmp/trl-smoke --cpu-smoke  # plumbing, CPU

The same work as configs/tictactoe-qwen0.5b.toml, without rlsys's extras:
- data: the 2048 training boards that rlsys generates (`jobs.items.load_items`: make_dataset(num_items, seed));
- prompt: rlsys's chat messages and `choose_square` schema, rendered by the model's own chat template with
  `tools=[CHOOSE_SQUARE_TOOL]` exactly as rlsys's proxy renders them (add_generation_prompt), and handed to TRL as
  text. Why text and not TRL's `tools=`: TRL's `tools` are Python callables that it *executes* and then samples
  again (a multi-turn tool loop), while rlsys scores the first call of one turn; and `chat_template_kwargs` cannot
  carry `tools` because GRPOTrainer already passes `tools=` to apply_chat_template (a duplicate keyword);
- reward: rlsys's own `rlsys.envs.tictactoe.reward.reward`, on the record the agent would have returned: the
  completion decoded as rlsys's proxy decodes it (special tokens kept, the end-of-turn token dropped), its tool
  calls parsed by rlsys's parser (`rlsys.proxy.toolcalls.parse_tool_calls`);
- 4 boards x 4 samples = 16 completions per optimizer step (micro-batches of 4, rlsys's `mini_bs`), the config's
  max_new_tokens, temperature, lr, warmup and grad clip, 8-bit AdamW (bitsandbytes), bf16 autocast over fp32
  weights (rlsys's `fp32_master`; TRL's `bf16=True` with a float32 model), or, when the config trains LoRA (its
  default since 2026-12-03), peft's LoRA of the same rank, alpha, dropout and target modules on a bf16 base (peft
  keeps the adapters in float32, as rlsys does; TRL merges them into vLLM's weights each step), GSPO
  (`importance_sampling_level="sequence"`, `loss_type="grpo"`: the mean over a sequence's tokens of a ratio that is
  one per sequence, then the mean over sequences, as rlsys/algos/gspo.py) with rlsys's clip epsilons (3e-4 / 4e-4),
  no KL (beta 0);
  `mask_truncated_completions` follows the config's `algo.mask_truncated`, `top_entropy_quantile` its
  `algo.top_entropy_frac` (the policy loss on the top-entropy tokens; since 2026-12-06 the config's 0.2);
- left out (rlsys's extras): dynamic sampling, the adaptive entropy bonus, decoupled logp_old, prefix sharing, the
  weight-push canary, evals.
  TRL keeps its defaults where rlsys has no counterpart (vLLM importance-sampling correction, CUDA graphs).

Writes into --out: steps.jsonl (per step: seconds since the process started, the step's seconds, reward mean and
std, the outcome table, the GPU memory in use), summary.json (command-to-last-step seconds, median step, peaks) and
final/ (a Hugging Face folder for `rlsys eval --ckpt`; a LoRA run's adapters merged into it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

PROCESS_START = psutil.Process().create_time()  # "time from the command": the interpreter's own start

GIB = 2**30
BOARDS_PER_STEP = 4
SAMPLES_PER_BOARD = 4  # the 4 x 4 (the rlsys config's own n_samples is 8 with dynamic sampling)
MICRO_BATCH = 4  # completions per forward/backward: rlsys's learner.mini_bs


# --- the task, as rlsys defines it ---------------------------------------------------------------------
def training_rows(cfg, tokenizer, count: int | None = None) -> list[dict]:
    """rlsys's training boards, each with its prompt rendered to text by the model's chat template."""
    from jobs.items import load_items
    from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for

    items = load_items(cfg.data, cfg.algo.name, cfg.env.environment())[:count]
    return [{"prompt": tokenizer.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                                     add_generation_prompt=True, tokenize=False), **item}
            for item in items]


def end_ids(tokenizer) -> set[int]:
    """The ids rlsys's proxy treats as the end of a turn (rlsys/proxy/server.py, `_ChatCodec.end_ids`)."""
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    ids.add(tokenizer.eos_token_id)
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def agent_output(text: str) -> dict:
    """What rlsys's tic-tac-toe agent returns for a completion `text` (the proxy's `_completion_body`)."""
    from rlsys.envs.tictactoe.prompt import TOOL_NAME
    from rlsys.proxy.toolcalls import parse_tool_calls

    parsed = parse_tool_calls(text, [TOOL_NAME])
    calls = [{"name": c.name, "arguments": json.dumps(c.arguments)} for c in parsed.calls]
    return {"content": (parsed.content or None) if calls else text, "tool_calls": calls,
            "finish_reason": "tool_calls" if calls else "stop"}


class TicTacToeReward:
    """A TRL reward function calling rlsys's reward; counts the outcome labels for the step log."""

    __name__ = "tictactoe"  # TRL names the reward's metrics after it

    def __init__(self, tokenizer):
        self.tokenizer, self.end_ids = tokenizer, end_ids(tokenizer)
        self.outcomes: Counter[str] = Counter()

    def text_of(self, ids: list[int]) -> str:
        ids = list(ids)
        while ids and ids[-1] in self.end_ids:  # the proxy drops the end-of-turn token (and TRL may pad with it)
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def __call__(self, prompts, completions, completion_ids, id, board, legal_moves, best_moves, **_) -> list[float]:
        from rlsys.envs.tictactoe.reward import outcome, reward

        rewards = []
        for ids, *item in zip(completion_ids, id, board, legal_moves, best_moves, strict=True):
            record = {"item": dict(zip(("id", "board", "legal_moves", "best_moves"), item)),
                      "output": agent_output(self.text_of(ids))}
            self.outcomes[outcome(record)] += 1
            rewards.append(reward(record))
        return rewards


# --- measuring -----------------------------------------------------------------------------------------
class DeviceMemoryPeak:
    """Polls the GPU's memory in use (all of it: TRL's learner and the colocated vLLM share the process)."""

    def __init__(self, every_s: float = 0.1):
        import torch

        self.peak = 0
        self.on = torch.cuda.is_available()
        if self.on:
            threading.Thread(target=self._poll, args=(torch, every_s), daemon=True).start()

    def _poll(self, torch, every_s: float) -> None:
        while True:
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(every_s)


def step_logger(out: Path, reward_fn: TicTacToeReward, memory: DeviceMemoryPeak):
    """A TrainerCallback writing one JSONL line per optimizer step (generation and update both inside it)."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self):
            self.file = (out / "steps.jsonl").open("w", encoding="utf-8")
            self.step_s: dict[int, float] = {}
            self.t_begin = 0.0

        def on_step_begin(self, args, state, control, **_):
            self.t_begin = time.time()

        def on_step_end(self, args, state, control, **_):
            self.step_s[state.global_step] = time.time() - self.t_begin

        def on_log(self, args, state, control, logs=None, **_):
            if state.global_step not in self.step_s or "reward" not in (logs or {}):
                return  # the end-of-training summary log
            n = max(sum(reward_fn.outcomes.values()), 1)
            line = {"step": state.global_step, "since_start_s": time.time() - PROCESS_START,
                    "step_s": self.step_s[state.global_step], "reward": logs.get("reward"),
                    "reward_std": logs.get("reward_std"),
                    **{f"outcome/{k}": v / n for k, v in sorted(reward_fn.outcomes.items())},
                    "device_used_peak_gib": memory.peak / GIB, "trl": logs}
            reward_fn.outcomes.clear()
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()

    return StepLog()


# --- the run -------------------------------------------------------------------------------------------
def grpo_config(cfg, out: Path, steps: int, smoke: bool, vllm_memory: float):
    import torch
    from trl import GRPOConfig

    eps_low, eps_high = cfg.algo.clip_eps()
    common = dict(
        output_dir=str(out / "trainer"), max_steps=steps, seed=cfg.seed, logging_steps=1, save_strategy="no",
        report_to="none", shuffle_dataset=cfg.data.shuffle, remove_unused_columns=False,
        num_generations=SAMPLES_PER_BOARD, temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
        max_completion_length=cfg.rollout.max_new_tokens,
        learning_rate=cfg.learner.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.learner.warmup_steps,
        weight_decay=cfg.learner.weight_decay, adam_beta1=cfg.learner.betas[0], adam_beta2=cfg.learner.betas[1],
        max_grad_norm=cfg.learner.max_grad_norm,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=eps_low, epsilon_high=eps_high, beta=0.0,
        num_iterations=cfg.algo.n_minibatches, scale_rewards="group",
        mask_truncated_completions=cfg.algo.mask_truncated,
        # the policy loss on the top-entropy tokens, as rlsys's `algo.top_entropy_frac` (TRL has no entropy bonus,
        # adaptive or fixed, to mirror `algo.entropy_target`)
        top_entropy_quantile=cfg.algo.top_entropy_frac or 1.0,
        # LoRA: a bf16 base (peft upcasts the adapters to float32); else fp32 masters under bf16 autocast, as
        # rlsys's fp32_master
        model_init_kwargs={"dtype": torch.bfloat16 if cfg.learner.lora.enabled else torch.float32},
    )
    if smoke:  # plumbing only: 2 boards x 2 samples, a few tokens, plain AdamW, no vLLM, on the CPU
        return GRPOConfig(**{**common, "num_generations": 2, "max_completion_length": 16},
                          per_device_train_batch_size=4, gradient_accumulation_steps=1, use_cpu=True, bf16=False,
                          optim="adamw_torch", use_vllm=False)
    return GRPOConfig(
        **common, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=BOARDS_PER_STEP * SAMPLES_PER_BOARD // MICRO_BATCH,  # one update per 16
        bf16=True, optim="adamw_bnb_8bit",
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_memory,
        vllm_max_model_length=cfg.rollout.max_model_len,
    )


def peft_config(cfg):
    """peft's LoraConfig for the rlsys config's `learner.lora` (None when it trains the whole model)."""
    lora = cfg.learner.lora
    if not lora.enabled:
        return None
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type="CAUSAL_LM")


def boards_dataset(rows: list[dict]):
    """The rows as a `datasets.Dataset` with a fingerprint of their JSON. `Dataset.from_list` fingerprints a new
    table by pickling it with dill, which with datasets 5.2.0 fails on every pyarrow 24-26 here ("Can't pickle
    <class 'MonthDayNano'>", 2026-12-04; it had passed on 2026-12-02): the fingerprint only names caches."""
    import hashlib

    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable(pa.Table.from_pylist(rows)), fingerprint=f"rlsys-boards-{digest}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder (the GGUF converted by rlsys)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs/tictactoe-qwen0.5b.toml"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--vllm-memory", type=float, default=0.2, help="vllm_gpu_memory_utilization (of the H200)")
    p.add_argument("--cpu-smoke", action="store_true", help="2 steps on the CPU, no vLLM, a tiny batch")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from rlsys.config import load_config

    cfg = load_config(args.config)
    steps = 2 if args.cpu_smoke else args.steps
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = training_rows(cfg, tokenizer, count=8 if args.cpu_smoke else None)
    reward_fn, memory = TicTacToeReward(tokenizer), DeviceMemoryPeak()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward_fn, processing_class=tokenizer,
                          args=grpo_config(cfg, args.out, steps, args.cpu_smoke, args.vllm_memory),
                          train_dataset=boards_dataset(rows), callbacks=[step_logger(args.out, reward_fn, memory)],
                          peft_config=peft_config(cfg))
    t_train = time.time()
    trainer.train()
    t_end = time.time()
    if cfg.learner.lora.enabled:  # an adapter folder is not what `rlsys eval --ckpt` loads: merge it
        trainer.model.merge_and_unload().save_pretrained(str(args.out / "final"))
    else:
        trainer.save_model(str(args.out / "final"))
    tokenizer.save_pretrained(str(args.out / "final"))

    lines = [json.loads(x) for x in (args.out / "steps.jsonl").read_text().splitlines()]
    step_s = [x["step_s"] for x in lines]
    summary = {
        "peer": "trl", "steps": len(lines), "command_to_last_step_s": lines[-1]["since_start_s"] if lines else None,
        "start_to_train_s": t_train - PROCESS_START, "train_s": t_end - t_train,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "median_step_s_after_5": statistics.median(step_s[5:]) if len(step_s) > 5 else None,
        "peak_device_used_gib": memory.peak / GIB if memory.on else None,
        "peak_torch_allocated_gib": torch.cuda.max_memory_allocated() / GIB if memory.on else None,
        "peak_torch_reserved_gib": torch.cuda.max_memory_reserved() / GIB if memory.on else None,
        "first_rewards": [x["reward"] for x in lines[:5]], "last_rewards": [x["reward"] for x in lines[-5:]],
        "final_model": str(args.out / "final"), "model": args.model, "cpu_smoke": args.cpu_smoke,
        "versions": {m.__name__: m.__version__ for m in (torch, __import__("trl"), __import__("transformers"))},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":  # vLLM's engine core may be spawned: the guard is required
    raise SystemExit(main())
