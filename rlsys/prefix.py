"""Prefix sharing for the learner: a group's shared prompt runs forward once, its KV cache serves every sample.

The n samples of a GSPO/GRPO group share one prompt (~234 tokens on tic-tac-toe) and differ in ~20 sampled
tokens, yet a plain forward runs every sequence's full length. Here the rows of a micro-batch whose prompts (the
tokens before their first loss-masked token) are identical form a sharing group; for each group:

1. the prompt minus its last token (the shared prefix, L tokens) runs once through the decoder with a KV cache,
   with grad: the groups' prefixes are right-padded into one (G, L_max) batch, causal attention only (padding at
   the end cannot reach the real tokens before it). Where the groups' prefixes themselves begin alike (the system
   prompt and tool schema of every board: ~210 of tic-tac-toe's ~234 tokens), that common part runs once before
   them, its cache gathered onto the groups, and each group's own rest after it (`common_prefix_length`;
   `learner.common_prefix_pass`);
2. the cache is indexed along the batch onto the group's members (`batch_select_indices`): a gather, so in the
   backward the members' key/value gradients are summed into the one prefix pass, which is exact;
3. the suffixes (the prompt's last token, then everything after it, right-padded) run with that cache, the 2-D
   attention mask over [L_max cached slots | suffix] (the group's padded slots L..L_max masked out) and position ids
   L, L+1, ...: the same positions, the same keys and values, so the same logits, as the unshared path.

The prompt's last token goes into the suffix because its logits predict the first sampled token; the prefix pass
needs no logits at all (it runs the decoder, not the LM head). Loss-masked tokens are never shared, so a multi-turn
segment shares only its first prompt and its later turns and tool results ride in the suffix. Rows whose prompt no
other row of the micro-batch has go through the plain forward, in the same micro-batch.

Needs a cache whose keys are plain per-position tensors and a mask built from cache lengths (transformers 5.x
`DynamicCache` with full-attention layers, checked against 5.24's `masking_utils`: the query offset is the cache
length, so causality holds in cache-slot order whatever the position ids). Off (callers use the plain path) under
gradient checkpointing, which drops the cache in training, for models with sliding-window or linear layers, and
for attention implementations other than sdpa and eager (tested on CPU only, sdpa).
"""
from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from rlsys.algos.logprobs import token_entropy, token_logprobs

EntropyMode = Literal["grad", "no_grad"] | None  # also return the entropies; with or without their graph


@dataclass(frozen=True)
class PrefixGroups:
    """Which rows of a micro-batch share a prefix. Row indices refer to the micro-batch's order."""

    members: list[list[int]] = field(default_factory=list)  # (G,) rows of each sharing group, >= 2 rows each
    lengths: list[int] = field(default_factory=list)  # (G,) shared tokens of each group: its prompt minus the last
    rest: list[int] = field(default_factory=list)  # rows on the plain path
    common: int = 0  # tokens that every group's prefix opens with, run once before them (`common_prefix_length`)

    def __post_init__(self) -> None:
        if len(self.members) != len(self.lengths):
            raise ValueError(f"PrefixGroups: {len(self.members)} groups but {len(self.lengths)} lengths")
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"PrefixGroups: shared lengths must be >= 1, got {self.lengths}")
        if self.common and not (len(self.lengths) >= 2 and 0 < self.common < min(self.lengths)):
            raise ValueError(f"PrefixGroups: a common prefix of {self.common} tokens needs >= 2 groups whose "
                             f"prefixes are all longer, got lengths {self.lengths}")

    @property
    def shared_rows(self) -> int:
        return sum(len(m) for m in self.members)


def find_prefix_groups(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                       min_members: int = 2) -> PrefixGroups:
    """Group the rows whose prompts (tokens before the first loss-masked one) are identical.

    Groups in order of first appearance; a prompt of fewer than 2 tokens (nothing left to share once its last
    token goes to the suffix), a row without sampled tokens, or a prompt held by fewer than `min_members` rows
    stays on the plain path. `common`: what the groups' prefixes all open with (`common_prefix_length`)."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    rest = []
    for i, (ids, mask) in enumerate(zip(input_ids, loss_masks)):
        first = next((t for t, m in enumerate(mask) if m), None)
        if first is None or first < 2:
            rest.append(i)
            continue
        by_prompt.setdefault(tuple(ids[:first]), []).append(i)
    members, lengths, prefixes = [], [], []
    for prompt, rows in by_prompt.items():
        if len(rows) >= min_members:
            members.append(rows)
            lengths.append(len(prompt) - 1)
            prefixes.append(prompt[:-1])
        else:
            rest += rows
    return PrefixGroups(members, lengths, sorted(rest), common_prefix_length(prefixes))


MIN_COMMON_PREFIX = 16  # shorter common prefixes are not given a pass of their own


def common_prefix_length(prefixes: Sequence[Sequence[int]]) -> int:
    """The tokens that every one of the groups' ``prefixes`` opens with, at most the shortest minus one (each group
    keeps a token of its own for phase 1); 0 for a single group or fewer than `MIN_COMMON_PREFIX` such tokens,
    i.e. nothing worth a pass of its own."""
    if len(prefixes) < 2:
        return 0
    common = min(len(os.path.commonprefix(list(prefixes))), min(len(p) for p in prefixes) - 1)
    return common if common >= MIN_COMMON_PREFIX else 0


def group_order(input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], by_length: bool = True
                ) -> list[int]:
    """A stable order of the rows that puts rows with the same prompt next to each other (first appearance
    first), so that a sharing group lands in one micro-batch, and within a prompt the shorter rows first, so that
    the micro-batches a group is cut into pad less: a micro-batch is as long as its longest row, and gsm's answers
    of one problem run from ~100 to ~1,500 tokens (learner's `train/padded_frac`). ``by_length=False``: a
    prompt's rows in their given order."""
    keys: dict[tuple[int, ...], int] = {}
    order = []
    for i, (ids, mask) in enumerate(zip(input_ids, loss_masks)):
        first = next((t for t, m in enumerate(mask) if m), len(mask))
        order.append((keys.setdefault(tuple(ids[:first]), len(keys)), len(ids) if by_length else 0, i))
    return [i for _, _, i in sorted(order)]


def sharing_supported(model: torch.nn.Module) -> str | None:
    """None if `shared_token_logprobs` is exact on this model, else why not (the caller uses the plain path)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers 5.x's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        return "gradient checkpointing drops the KV cache in training"
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))}: only full-attention caches are shared"
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):  # flash/flex kernels unpad the 2-D mask their own way: not checked here
        return f"attention implementation {attn!r}: prefix sharing is checked with sdpa and eager only"
    if _cache_kwarg(model) is None:
        return f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`"
    return None


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """transformers 5.x renamed `past_key_values` to `cache` (the old name warns until 5.40)."""
    params = inspect.signature(type(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def plain_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         entropy: EntropyMode = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(B, T-1) logprobs of input_ids[:, 1:] from one full forward: the path prefix sharing must equal.

    With `entropy` ("grad" or "no_grad") also the (B, T-1) entropy of each position's distribution, from the
    same logits (see `_logprobs_from_logits`)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)
    return _logprobs_from_logits(logits, input_ids, entropy)


def _logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor,
                          entropy: EntropyMode) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """logits (B, T, V) over input_ids (B, T) -> logprobs (B, T-1) of input_ids[:, 1:], and with `entropy` the
    entropies (B, T-1): "grad" keeps their graph (an entropy bonus), "no_grad" only reads the logits (the metric; no
    memory kept for backward).

    The model's logits go in whole, in their own dtype: `token_logprobs` reads them in float32 chunks and keeps only
    them and a logsumexp per row for backward. Neither `.float()` (a (B, T, V) float32 copy, kept for backward: the
    5 GiB that ran a gsm job out of memory) nor the slice `[:, :-1]` (copied to be flattened) is taken; the last
    position is scored against an arbitrary id of the row and dropped."""
    targets = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)  # (B, T): the last column is dropped
    logp = token_logprobs(logits, targets)[:, :-1]  # (B, T-1)
    if entropy is None:
        return logp
    if entropy == "grad":
        return logp, token_entropy(logits)[:, :-1]
    with torch.no_grad():
        return logp, token_entropy(logits)[:, :-1]


def shared_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T) right-padded
    attention_mask: torch.Tensor,  # (B, T) 1 on real tokens
    groups: PrefixGroups,
    entropy: EntropyMode = None,
    common: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # (B, T-1): [b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])
    """Per-token logprobs of a micro-batch, the groups' prefixes run once, and with ``common`` the part that they
    all open with once before them (see the module docstring).

    Equal to `plain_token_logprobs` wherever input_ids[b, t+1] comes after the row's shared prefix (every
    loss-masked token); 0 on a shared row's prefix and padding positions, which are never loss-masked. With
    `entropy`, also the (B, T-1) entropies, equal to the plain path's at the same positions (0 where logprobs are)."""
    B, T = input_ids.shape
    device = input_ids.device
    order = groups.rest + [r for m in groups.members for r in m]
    if sorted(order) != list(range(B)):
        raise ValueError(f"shared_token_logprobs: groups cover rows {sorted(order)}, the batch has {B}")
    parts = []  # each a (B_part, T-1) tensor, or a (logprobs, entropies) pair of them
    if groups.rest:
        rest = torch.tensor(groups.rest, device=device)
        parts.append(plain_token_logprobs(model, input_ids[rest], attention_mask[rest], entropy))  # (B_r, T-1)
    if groups.members:
        parts.append(_suffix_logprobs(model, input_ids, attention_mask, groups, T, entropy, common))  # (B_s, T-1)
    inverse = torch.empty(B, dtype=torch.long, device=device)
    inverse[torch.tensor(order, device=device)] = torch.arange(B, device=device)
    if entropy is None:
        return torch.cat(parts)[inverse]  # (B, T-1), from `order` back to the batch's
    return torch.cat([p[0] for p in parts])[inverse], torch.cat([p[1] for p in parts])[inverse]


def tokens_saved(groups: PrefixGroups, common: bool = True) -> int:
    """Tokens that `shared_token_logprobs` does not run through the decoder, against the plain forward of the same
    rows: each group's prefix for all members but one, and (``common``) the groups' common prefix for all groups
    but one."""
    saved = sum((len(m) - 1) * n for m, n in zip(groups.members, groups.lengths))
    return saved + (len(groups.lengths) - 1) * groups.common if common else saved


def _suffix_logprobs(model, input_ids, attention_mask, groups: PrefixGroups, T: int, entropy: EntropyMode = None,
                     common: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    device, pad = input_ids.device, 0
    lengths = groups.lengths
    L_max = max(lengths)
    seq_lens = attention_mask.sum(-1).tolist()  # (B,) real tokens per row (right padding)

    # Phase 1: the prefixes, one row per group, right-padded; the decoder only (no LM head), with grad.
    prefix = torch.full((len(lengths), L_max), pad, dtype=input_ids.dtype, device=device)  # (G, L_max)
    for g, (m, n) in enumerate(zip(groups.members, lengths)):
        prefix[g, :n] = input_ids[m[0], :n]
    cache = DynamicCache(config=model.config)
    kw = _cache_kwarg(model)
    head = groups.common if common else 0  # tokens of phase 0
    if head:
        # Phase 0: the tokens that every group's prefix starts with (a system prompt and tool schema), once, then
        # its cache onto the groups (a gather: the backward sums the groups' gradients into this pass). Phase 1
        # runs the rests after it at positions head, head + 1, ...: the cache holds the same keys and values
        # in the same slots as a pass over the whole prefixes (each group's real slots 0..n-1, its padding after).
        model.base_model(input_ids=prefix[:1, :head], use_cache=True, **{kw: cache})
        cache.batch_select_indices(torch.zeros(len(lengths), dtype=torch.long, device=device))
        positions = torch.arange(head, L_max, device=device)[None].expand(len(lengths), -1)  # (G, L_max - head)
        model.base_model(input_ids=prefix[:, head:], position_ids=positions, use_cache=True, **{kw: cache})
    else:
        model.base_model(input_ids=prefix, use_cache=True, **{kw: cache})

    # Phase 2: the cache onto the members (a gather: the backward sums the members' gradients into the prefix).
    member_group = [g for g, m in enumerate(groups.members) for _ in m]
    cache.batch_select_indices(torch.tensor(member_group, device=device))  # (B_s, kv_heads, L_max, d) per layer

    # Phase 3: the suffixes from each group's last prompt token, right-padded, at positions L, L+1, ...
    rows = [r for m in groups.members for r in m]
    starts = [lengths[g] for g in member_group]  # (B_s,) first suffix position of each member
    suffix_lens = [seq_lens[r] - s for r, s in zip(rows, starts)]
    S = max(suffix_lens)
    suffix = torch.full((len(rows), S), pad, dtype=input_ids.dtype, device=device)  # (B_s, S)
    mask = torch.zeros((len(rows), L_max + S), dtype=attention_mask.dtype, device=device)  # (B_s, L_max + S)
    for k, (r, s, n) in enumerate(zip(rows, starts, suffix_lens)):
        suffix[k, :n] = input_ids[r, s : s + n]
        mask[k, :s] = 1
        mask[k, L_max : L_max + n] = 1
    start = torch.tensor(starts, device=device)
    positions = start[:, None] + torch.arange(S, device=device)[None, :]  # (B_s, S)
    logits = model(input_ids=suffix, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{kw: cache}).logits  # (B_s, S, V)
    out = _logprobs_from_logits(logits, suffix, entropy)  # (B_s, S-1), or a pair

    # Phase 4: back onto the full rows' positions: suffix column j is full column start + j.
    k_idx, j_idx = [], []
    for k, n in enumerate(suffix_lens):
        k_idx += [k] * (n - 1)
        j_idx += range(n - 1)
    k_t = torch.tensor(k_idx, dtype=torch.long, device=device)
    j_t = torch.tensor(j_idx, dtype=torch.long, device=device)

    def to_full(x: torch.Tensor) -> torch.Tensor:  # (B_s, S-1) -> (B_s, T-1)
        full = torch.zeros((len(rows), T - 1), dtype=x.dtype, device=device)
        return full.index_put((k_t, start[k_t] + j_t), x[k_t, j_t])

    return to_full(out) if entropy is None else (to_full(out[0]), to_full(out[1]))
