"""GRPO (DeepSeekMath, arXiv 2402.03300) with DAPO's token-level loss: the token-ratio baseline to GSPO.

For every loss-masked token t of sequence i, with the sequence's group-normalised advantage A_i:

    r_i,t  = exp(logp_new[i, t] - logp_old[i, t])
    J_i,t  = min( r_i,t A_i, clip(r_i,t, 1 - eps_low, 1 + eps_high) A_i )
    loss   = -sum_{i,t} w_i,t J_i,t / normalizer

How this departs from the GRPO paper, on purpose:

- Token-mean aggregation over the whole batch (DAPO, arXiv 2503.14476), not the paper's mean over
  sequences of per-sequence token means: every sampled token weighs the same, so long responses are
  not down-weighted per token.
- Asymmetric "clip-higher" range, eps_low 0.2 / eps_high 0.28 by default (DAPO).
- No KL penalty against a reference model and no entropy bonus here: both are optional terms the learner adds
  (`rlsys/algos/regularizers.py`, `algo.kl_coef` / `algo.entropy_coef`, off by default).
- The token log-ratio is clamped to [-20, 20] before exp (as verl does); beyond it the gradient is zero.
- Truncated importance sampling, when ``logp_rollout`` is given and ``cfg.tis_cap`` is set, is per token:
  w_i,t = min(exp(logp_old - logp_rollout), tis_cap), detached (off by default for GRPO).
- With one optimizer step per rollout batch r_i,t == 1 and this is token-level REINFORCE with a group
  baseline.

Gradient accumulation: by default the loss is the mean over *this micro-batch's* masked tokens. Pass
``normalizer = grpo_normalizer(whole batch's loss_mask)`` (the masked tokens of the whole optimizer batch)
and the sum of the micro-batch losses is exactly the batch token-mean, with no further division.
Metrics use the same names as ``gspo_loss``; ratio and clip fractions are over tokens here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlsys.algos.logprobs import check_clip_config, check_policy_loss_inputs, masked_mean, reduce_policy_loss

_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class GRPOConfig:
    clip_eps_low: float = 0.2  # clip r_t below at 1 - clip_eps_low (bites when A < 0)
    clip_eps_high: float = 0.28  # clip r_t above at 1 + clip_eps_high (bites when A > 0)
    tis_cap: float | None = None  # cap on the per-token truncated importance weight; None disables

    def __post_init__(self) -> None:
        check_clip_config(self)


def grpo_normalizer(loss_mask: torch.Tensor) -> float:  # (B, T)
    """The default normalizer of ``grpo_loss``: the number of masked tokens."""
    return float(loss_mask.bool().sum())


def grpo_loss(
    logp_new: torch.Tensor,  # (B, T) learner logprobs of the sampled tokens, with grad
    logp_old: torch.Tensor,  # (B, T) logprobs of the policy that sampled (or the learner's recompute)
    advantages: torch.Tensor,  # (B,) one advantage per sequence, broadcast over its tokens
    loss_mask: torch.Tensor,  # (B, T) bool or 0/1: 1 on sampled tokens only
    cfg: GRPOConfig = GRPOConfig(),
    logp_rollout: torch.Tensor | None = None,  # (B, T) engine sampling logprobs, "decoupled" mode
    normalizer: float | None = None,  # masked tokens in the whole optimizer batch; default: this one's
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar token-level GRPO loss (to minimise) and float metrics over this micro-batch."""
    check_policy_loss_inputs("grpo_loss", logp_new, logp_old, advantages, loss_mask, normalizer)
    mask = loss_mask.bool()  # (B, T)
    logp_old = logp_old.detach()
    adv = advantages.detach().to(logp_new.dtype)[:, None]  # (B, 1)

    # Phase 1: token ratio and the clipped objective. Padding is zeroed before exp so inf/NaN there
    # cannot reach the loss or the gradient.
    zero = torch.zeros((), dtype=logp_new.dtype, device=logp_new.device)
    log_ratio = torch.where(mask, logp_new - logp_old, zero)  # (B, T)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # (B, T)
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)  # (B, T)
    tok_loss = torch.maximum(-adv * ratio, -adv * clipped)  # (B, T)

    # Phase 2: per-token truncated importance weight against the engine's sampling distribution.
    tis = None
    if logp_rollout is not None and cfg.tis_cap is not None:
        log_w = torch.where(mask, logp_old - logp_rollout.detach(), zero)  # (B, T)
        tis = torch.exp(log_w.clamp(max=math.log(cfg.tis_cap)))  # (B, T) detached
        tok_loss = tok_loss * tis

    # Phase 3: token sum over the batch, divided by the (batch or micro-batch) token count; metrics per token.
    loss, metrics = reduce_policy_loss(tok_loss, mask, normalizer, cfg, ratio, adv, logp_old, logp_new, mask,
                                       logp_rollout)
    if tis is not None:
        metrics["train/tis_weight_mean"] = float(masked_mean(tis, mask))
    return loss, metrics
