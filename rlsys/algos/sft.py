"""Supervised fine-tuning loss: masked token-mean cross-entropy.

Same shift convention as ``token_logprobs``: ``logits[:, t]`` predicts ``target_ids[:, t]``; the caller
shifts. Same memory behaviour too: the cross-entropy goes through ``token_logprobs`` (chunked, no full
float32 log_softmax copy). No label smoothing, no ignore_index: the mask says which tokens count, and
``target_ids`` must hold a valid id everywhere (any id on padding).

Gradient accumulation: by default the loss is the mean over *this micro-batch's* masked tokens. Pass
``normalizer`` = the masked tokens of the whole optimizer batch and the sum of the micro-batch losses is
exactly the batch token-mean, with no further division.
"""
from __future__ import annotations

import torch

from rlsys.algos.logprobs import token_logprobs


def sft_loss(
    logits: torch.Tensor,  # (B, T, V) already shifted: logits[:, t] predicts target_ids[:, t]
    target_ids: torch.Tensor,  # (B, T) long, every id in [0, V)
    loss_mask: torch.Tensor,  # (B, T) bool or 0/1: 1 on the tokens to learn
    normalizer: float | None = None,  # masked tokens in the whole optimizer batch; default: this one's
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar cross-entropy loss and metrics over this micro-batch.

    Metrics: ``train/loss`` (token-mean NLL of this micro-batch, whatever the normalizer),
    ``train/sft_token_acc`` (argmax == target over masked tokens), ``train/num_tokens``.
    """
    if loss_mask.shape != target_ids.shape:
        raise ValueError(
            f"sft_loss: loss_mask {tuple(loss_mask.shape)} must match target_ids {tuple(target_ids.shape)}"
        )
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"sft_loss: normalizer must be > 0, got {normalizer}")
    mask = loss_mask.bool()  # (B, T)
    nll = -token_logprobs(logits, target_ids)  # (B, T) float32
    nll = torch.where(mask, nll, torch.zeros((), dtype=nll.dtype, device=nll.device))
    num_tokens = mask.sum()
    denom = normalizer if normalizer is not None else num_tokens.clamp(min=1)
    loss = nll.sum() / denom

    with torch.no_grad():
        n = int(num_tokens)
        correct = (logits.argmax(-1) == target_ids) & mask  # (B, T)
        metrics = {
            "train/loss": float(nll.sum()) / max(n, 1),
            "train/sft_token_acc": int(correct.sum()) / max(n, 1),
            "train/num_tokens": float(n),
        }
    return loss, metrics
