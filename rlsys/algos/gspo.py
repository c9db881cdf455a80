"""GSPO: Group Sequence Policy Optimization (Qwen, arXiv 2507.18071), sequence-level clipped loss.

For trajectory i with sampled (loss-masked) tokens t = 1..|y_i| and group-normalised advantage A_i:

    s_i    = exp( mean_t (logp_new[i, t] - logp_old[i, t]) )        (computed in log space)
    J_i    = min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )
    loss   = -sum_i w_i J_i / normalizer

How this departs from, or pins down, the paper:

- The plain sequence variant. The paper's GSPO-token form, s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] with
  A_i,t = A_i, has the same value, the same clipping decisions and the same gradient, so it is not
  implemented separately.
- With one optimizer step per rollout batch (``n_minibatches = 1``), logp_old equals logp_new at the
  step, s_i == 1, nothing is clipped and GSPO reduces to sequence-level REINFORCE with a group baseline:
  grad = -(1/N) sum_i A_i * mean_t grad logp_new[i, t]. Clipping only acts from the second optimizer
  step on a batch (or when logp_old comes from stale engine weights, the "bypass" mode).
- No KL penalty and no entropy bonus here (the paper trains without a reference model too); both are optional
  terms the learner adds (`rlsys/algos/regularizers.py`, `algo.kl_coef` / `algo.entropy_coef`, off by default).
- The sequence log-ratio is clamped to [-20, 20] before exp (as verl does) so one diverged sequence
  gives a large finite loss instead of inf/NaN; beyond the clamp its gradient is zero.
- Truncated importance sampling ("decoupled" mode): when ``logp_rollout`` (the engine's sampling
  logprobs) is given and ``logp_old`` was recomputed by the learner, each sequence is weighted by the
  detached w_i = min(exp(mean_t(logp_old - logp_rollout)), tis_cap), correcting for the engine/learner
  mismatch. ``tis_cap=None`` disables the weight (the mismatch is still logged).
- Aggregation: a mean over sequences that have at least one loss-masked token (as the paper's
  1/G sum over a group, pooled over groups). Sequences with advantage 0 (zero-variance groups) still
  count in the denominator, as in the paper; drop them upstream for DAPO-style dynamic sampling.

Gradient accumulation: by default the loss is the mean over *this micro-batch's* sequences, so a
learner that sums micro-batch losses must divide by the number of micro-batches (exact only when they
hold equal numbers of sequences). Pass ``normalizer = gspo_normalizer(whole batch's loss_mask)``
(the number of sequences with a masked token in the whole optimizer batch) and the sum of the
micro-batch losses is exactly the batch mean, with no further division.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlsys.algos.logprobs import check_clip_config, check_policy_loss_inputs, masked_mean, reduce_policy_loss

_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class GSPOConfig:
    clip_eps_low: float = 3e-4  # clip s_i below at 1 - clip_eps_low (bites when A_i < 0)
    clip_eps_high: float = 4e-4  # clip s_i above at 1 + clip_eps_high (bites when A_i > 0)
    tis_cap: float | None = 2.0  # cap on the truncated importance weight; None disables it

    def __post_init__(self) -> None:
        check_clip_config(self)


def gspo_normalizer(loss_mask: torch.Tensor) -> float:  # (B, T)
    """The default normalizer of ``gspo_loss``: sequences with at least one masked token."""
    return float((loss_mask.bool().sum(-1) > 0).sum())


def gspo_loss(
    logp_new: torch.Tensor,  # (B, T) learner logprobs of the sampled tokens, with grad
    logp_old: torch.Tensor,  # (B, T) logprobs of the policy that sampled (or the learner's recompute)
    advantages: torch.Tensor,  # (B,) one advantage per sequence
    loss_mask: torch.Tensor,  # (B, T) bool or 0/1: 1 on sampled tokens only
    cfg: GSPOConfig = GSPOConfig(),
    logp_rollout: torch.Tensor | None = None,  # (B, T) engine sampling logprobs, "decoupled" mode
    normalizer: float | None = None,  # sequences in the whole optimizer batch; default: this one's
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar GSPO loss (to minimise) and float metrics over this micro-batch."""
    check_policy_loss_inputs("gspo_loss", logp_new, logp_old, advantages, loss_mask, normalizer)
    mask = loss_mask.bool()  # (B, T)
    seq_valid = mask.sum(-1) > 0  # (B,)
    logp_old = logp_old.detach()
    adv = advantages.detach().to(logp_new.dtype)  # (B,)

    # Phase 1: sequence ratio and the clipped objective.
    log_ratio = masked_mean(logp_new - logp_old, mask, dim=-1)  # (B,)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # (B,)
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)  # (B,)
    seq_loss = torch.maximum(-adv * ratio, -adv * clipped)  # (B,)

    # Phase 2: truncated importance weight against the engine's sampling distribution.
    tis = None
    if logp_rollout is not None and cfg.tis_cap is not None:
        log_w = masked_mean(logp_old - logp_rollout.detach(), mask, dim=-1)  # (B,)
        tis = torch.exp(log_w.clamp(max=math.log(cfg.tis_cap)))  # (B,) detached: no grad inputs
        seq_loss = seq_loss * tis

    # Phase 3: aggregate over sequences that have tokens; metrics per sequence.
    loss, metrics = reduce_policy_loss(seq_loss, seq_valid, normalizer, cfg, ratio, adv, logp_old, logp_new, mask,
                                       logp_rollout)
    if tis is not None:
        metrics["train/tis_weight_mean"] = float(tis[seq_valid].sum()) / max(int(seq_valid.sum()), 1)
    return loss, metrics
