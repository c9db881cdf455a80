"""The job's items, checked before Ray starts: plug-ins, the training and held-out data, the memory budget.

`preflight` refuses what it can before any process starts (exit 2 with one line, `rlsys.errors.UserInputError`);
`load_items` and `load_eval_items` are also what `rlsys eval` and the scripts use to get the same boards.
"""
from __future__ import annotations

import sys
from typing import Any

from rlsys.config import Config, ConfigError, DataConfig
from rlsys.data import DatasetError, read_jsonl
from rlsys.models.resolve import resolve_model
from rlsys.plugins import load_agent, load_reward


def item_validator(algo: str, reward_fn_path: str):
    """What every dataset line must satisfy: an SFT chat (``algo`` sft), or the reward file's optional
    `validate_item`."""
    if algo == "sft":
        return validate_chat
    reward_fn, _ = load_reward(reward_fn_path)
    return getattr(sys.modules[reward_fn.__module__], "validate_item", None)


def validate_chat(item: dict[str, Any]) -> None:
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("an SFT item needs a non-empty 'messages' list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}]: needs a role of system, user, assistant or tool")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message to learn")


def preflight(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Everything that can be refused before Ray starts: plug-ins, training and held-out data, a memory budget
    the job does not fit."""
    load_agent(cfg.env.agent_fn)
    load_reward(cfg.env.reward_fn_path)
    check_memory_budget(cfg)
    items = load_items(cfg.data, cfg.algo.name, cfg.env.reward_fn_path)
    wants_eval = cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every
    return items, load_eval_items(cfg.data, cfg.algo.name, cfg.env.reward_fn_path) if wants_eval else []


def check_memory_budget(cfg: Config) -> None:
    """`rollout.gpu_memory_budget_gib`: estimate the co-located job's GPU memory (rlsys/memory.py) and refuse it
    (ConfigError, exit 2: the estimate table and settings that fit) if it is over the budget or the device."""
    if cfg.rollout.gpu_memory_budget_gib is None:
        return
    from rlsys.memory import GIB, MemoryBudgetError, check_budget, device_total_bytes_nvml

    try:
        est = check_budget(cfg, resolve_model(cfg.model.ckpt), device_total_bytes_nvml())
    except MemoryBudgetError as err:
        raise ConfigError(str(err)) from None
    split = est.split()
    print(f"rlsys: memory budget {cfg.rollout.gpu_memory_budget_gib:g} GiB: estimated {est.total_bytes / GIB:.1f} GiB "
          f"(learner {est.learner_bytes / GIB:.1f}, engine {est.engine_bytes / GIB:.1f}); shares: learner "
          f"{split.learner_bytes / GIB:.1f} GiB, engine {split.engine_bytes / GIB:.1f} GiB", flush=True)


def load_items(data: DataConfig, algo: str, reward_fn_path: str) -> list[dict[str, Any]]:
    """Training items: the dataset file (checked by `item_validator`), or the generated tic-tac-toe boards
    (format-only chats for ``algo`` sft)."""
    if data.dataset_path:
        return read_jsonl(data.dataset_path, validate=item_validator(algo, reward_fn_path))
    from rlsys.envs.tictactoe.dataset import make_dataset

    boards = make_dataset(data.num_items, data.seed)
    if algo == "sft":
        from rlsys.envs.tictactoe.sft_data import make_sft_dataset

        return make_sft_dataset(boards, data.num_items, data.seed)
    return boards


def load_eval_items(data: DataConfig, algo: str, reward_fn_path: str) -> list[dict[str, Any]]:
    """Held-out items: the eval file (checked by the reward file's `validate_item`), or generated tic-tac-toe
    boards disjoint from the training boards."""
    if data.eval_path:
        reward_fn, _ = load_reward(reward_fn_path)
        return read_jsonl(data.eval_path, validate=getattr(sys.modules[reward_fn.__module__], "validate_item", None))
    if data.dataset_path and algo != "sft":
        raise DatasetError("data.eval_path: evaluating on a custom dataset needs its own held-out file")
    from rlsys.envs.tictactoe.dataset import make_dataset

    train_boards = [item["board"] for item in make_dataset(data.num_items, data.seed)]
    return make_dataset(data.num_eval_items, data.seed + 1, exclude=train_boards)
