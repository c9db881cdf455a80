"""The learner's training rows (a trajectory's segment and its advantage) and how they become batches
(actors/learner.py)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlsys.prefix import (EntropyMode, find_prefix_groups, group_order, plain_token_logprobs, shared_token_logprobs,
                          sharing_supported, tokens_saved)
from rlsys.types import Segment, Trajectory


@dataclass
class Row:
    """One training sequence: a segment of a trajectory and the trajectory's advantage."""

    segment: Segment
    advantage: float  # the trajectory's advantage, divided among its segments (see `_policy_rows`)
    group: int
    weight: float = 1.0  # 1 / number of training segments of its trajectory


@torch.no_grad()
def weights_digest(params: Sequence[torch.Tensor]) -> float:
    """A float64 fingerprint of weights (every parameter's sum plus its sum of squares, accumulated in float64
    without float64 copies): equal for bit-equal weights, moved by a single changed element."""
    total = torch.zeros((), dtype=torch.float64, device=params[0].device if params else "cpu")
    for p in params:
        total += p.sum(dtype=torch.float64) + torch.linalg.vector_norm(p, dtype=torch.float64) ** 2
    return float(total)


def resolve_trajectories(items: Sequence[Any]) -> list[Trajectory]:
    if items and not isinstance(items[0], Trajectory):
        import ray  # only on the Ray path: ObjectRefs from the env workers

        items = ray.get(list(items))
    return list(items)


def micro_batches(rows: Sequence[Row], mini_bs: int, token_budget: int | None = None) -> list[list[Row]]:
    """``rows`` cut in order into micro-batches: ``mini_bs`` rows each, or with ``token_budget``
    (`learner.micro_batch_tokens`) as many consecutive rows as keep rows x longest row within it (one row at least)."""
    if not token_budget:
        return [list(rows[i : i + mini_bs]) for i in range(0, len(rows), mini_bs)]
    out: list[list[Row]] = []
    longest = 0
    for r in rows:
        n = len(r.segment.input_ids)
        if out and (len(out[-1]) + 1) * max(longest, n) <= token_budget:
            out[-1].append(r)
            longest = max(longest, n)
        else:
            out.append([r])
            longest = n
    return out


def split_rows(rows: list[Row], n: int) -> list[list[Row]]:
    size = math.ceil(len(rows) / n)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def collate(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors of ids, attention mask, loss mask and rollout logprobs; and the reference's
    logprobs (`ref_logprobs`) when every row carries them (`learner.reference_actor`)."""
    T = max(len(r.segment.input_ids) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    lp = torch.zeros((B, T), dtype=torch.float32)
    ref = torch.zeros((B, T), dtype=torch.float32) if all(r.segment.ref_logprobs is not None for r in rows) else None
    for i, r in enumerate(rows):
        n = len(r.segment.input_ids)
        ids[i, :n] = torch.tensor(r.segment.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(r.segment.loss_mask, dtype=torch.float32)
        lp[i, :n] = torch.tensor(r.segment.rollout_logprobs, dtype=torch.float32)
        if ref is not None:
            ref[i, :n] = torch.tensor(r.segment.ref_logprobs, dtype=torch.float32)
    out = {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": mask.to(device),
           "rollout_logprobs": lp.to(device)}
    if ref is not None:
        out["ref_logprobs"] = ref.to(device)
    return out


def prefix_settings(learner: Any, algo_name: str, model: torch.nn.Module, device: torch.device) -> tuple[bool, bool]:
    """(prefix sharing, common prefix pass) for ``model`` under the job's `learner` section: the policy's and the
    reference actor's forwards take the same path."""
    sharing = learner.prefix_sharing and algo_name != "sft"
    if sharing and (why := sharing_supported(model)) is not None:
        print(f"rlsys: learner.prefix_sharing off: {why}", flush=True)
        sharing = False
    common = learner.common_prefix_pass
    return sharing, sharing and (device.type == "cpu" if common is None else common)


def row_logprobs(model: torch.nn.Module, rows: list[Row], batch: dict[str, torch.Tensor], *, sharing: bool,
                 common: bool, entropy: EntropyMode = None, counts: list[int] | None = None) -> Any:
    """(B, T-1) logprobs of each row's tokens under ``model`` (``batch``: `collate(rows)`), the prompts that rows
    share run once with ``sharing`` (`rlsys/prefix.py`; loss-masked tokens exact); with ``entropy``, a pair
    (logprobs, entropies). ``counts``: [input tokens not run, input tokens in all], added to."""
    ids, attn = batch["input_ids"], batch["attention_mask"]
    if not sharing:
        return plain_token_logprobs(model, ids, attn, entropy)
    groups = find_prefix_groups([r.segment.input_ids for r in rows], [r.segment.loss_mask for r in rows])
    if counts is not None:
        counts[0] += tokens_saved(groups, common=common)
        counts[1] += int(attn.sum())
    if not groups.members:
        return plain_token_logprobs(model, ids, attn, entropy)
    return shared_token_logprobs(model, ids, attn, groups, entropy, common=common)


def prompt_order(rows: list[Row], sharing: bool, by_length: bool) -> list[Row]:
    """Rows that share a prompt next to each other, shorter first (`rlsys.prefix.group_order`): with prefix
    sharing they share a micro-batch's prompt forward, and either way the micro-batches pad less."""
    if not (sharing or by_length):
        return rows
    order = group_order([r.segment.input_ids for r in rows], [r.segment.loss_mask for r in rows], by_length=by_length)
    return [rows[i] for i in order]


def pad_stack(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    T = max(r.shape[0] for r in rows)
    out = torch.zeros((len(rows), T), device=device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
