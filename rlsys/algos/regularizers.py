"""Terms added to the policy loss: an entropy bonus and a KL penalty to a frozen reference policy.

For the sampled (loss-masked) tokens t of the sequences i of one optimizer batch, with H_i,t the entropy of the
policy's next-token distribution and d_i,t = logp_ref[i, t] - logp_new[i, t]:

    k3_i,t  = exp(d_i,t) - d_i,t - 1                     (Schulman's k3 estimator of KL(pi_new || pi_ref))
    loss    = ( kl_coef * sum_{i,t} k3_i,t - entropy_coef * sum_{i,t} H_i,t ) / normalizer

so `loss -= entropy_coef * mean entropy` and `loss += kl_coef * mean KL`, added to GSPO's or GRPO's loss.

Choices, on purpose:

- Token-mean over the batch's sampled tokens for both terms, whatever the policy loss aggregates (GSPO: sequences,
  GRPO: tokens); verl's default `token-mean` for its kl and entropy terms. Pass ``normalizer`` = the sampled tokens of
  the whole optimizer batch and the micro-batch losses sum to the batch mean.
- k3 is non-negative, unbiased for samples of pi_new, and has the low variance that made it the default of GRPO's
  paper and verl's `low_var_kl`. d is clamped to [-20, 20] before exp (as verl does), so one token whose
  reference logprob collapsed gives a large finite penalty, not inf.
- The entropy is exact (the whole vocabulary, `rlsys.algos.logprobs.token_entropy`), not the sampled token's
  surprisal; its gradient flows only when an entropy coefficient is set (the caller computes it under no_grad
  otherwise).
- Metrics (`train/entropy`, `train/kl_ref`) are this micro-batch's token means, logged whether or not the
  coefficients are set, so the entropy can be watched without adding a bonus.

`EntropyController` is Skywork-OR1's adaptive entropy control (He et al. 2025, `algo.entropy_target`): a fixed
bonus either does too little or blows the entropy up, depending on the model and the data, so the coefficient
follows the entropy instead. After each rollout batch with measured entropy e, `coef` moves by `step` towards more
bonus while e < target and towards none above it (clamped to [0, max_coef]), and the bonus applied next (`active`)
is `coef` below the target and 0 above it: the entropy loss acts only while the entropy is too low. Pure Python
floats, so the learner can checkpoint it and all ranks can agree on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlsys.algos.logprobs import masked_mean

_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class RegularizerConfig:
    entropy_coef: float = 0.0  # loss -= entropy_coef * token-mean entropy; 0 = no bonus
    kl_coef: float = 0.0  # loss += kl_coef * token-mean k3 KL to the reference; 0 = no penalty

    def __post_init__(self) -> None:
        if self.entropy_coef < 0.0 or self.kl_coef < 0.0:
            raise ValueError(f"RegularizerConfig: coefficients must be >= 0: {self}")


@dataclass
class EntropyController:
    """Skywork-OR1's adaptive entropy coefficient (module docstring). The learner calls `update` once per `train` call
    with that call's `train/entropy` and applies `active` as `RegularizerConfig.entropy_coef` in the next one."""

    target: float  # the entropy to hold (algo.entropy_target), > 0
    step: float  # how much coef moves per update (algo.entropy_coef_step), > 0
    max_coef: float  # coef's ceiling (algo.entropy_coef_max)
    coef: float = 0.0  # the adaptive coefficient; starts at algo.entropy_coef
    active: float = 0.0  # the coefficient to apply now: coef below the target, 0 above it (the start's: coef)

    def __post_init__(self) -> None:
        if not (self.target > 0.0 and self.step > 0.0):
            raise ValueError(f"EntropyController: target and step must be > 0: {self}")
        if not 0.0 <= self.coef <= self.max_coef or not 0.0 <= self.active <= self.max_coef:
            raise ValueError(f"EntropyController: coef and active must be in [0, max_coef]: {self}")

    def update(self, entropy: float) -> None:
        """One rollout batch's mean token entropy in. Non-finite (no entropy measured, a NaN step): no change, so a
        broken batch neither raises nor drops the bonus."""
        if not math.isfinite(entropy):
            return
        if entropy < self.target:
            self.coef = min(self.max_coef, self.coef + self.step)
            self.active = self.coef
        else:
            self.coef = max(0.0, self.coef - self.step)
            self.active = 0.0

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: the moving parts only. target, step and max_coef come from the resumed job's
        config, so a resume may change them."""
        return {"coef": float(self.coef), "active": float(self.active)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore `state_dict`'s values, clamped to this controller's [0, max_coef] (a resume may lower the cap)."""
        self.coef = min(self.max_coef, max(0.0, float(state["coef"])))
        self.active = min(self.max_coef, max(0.0, float(state["active"])))


def decayed_kl_coef(kl_coef: float, decay: tuple[int, int, float] | None, optimizer_steps: int) -> float:
    """`algo.kl_decay`'s coefficient for the batch after `optimizer_steps` optimizer steps: `kl_coef` up to `start`,
    linear to `final` at `end`, `final` after (None: `kl_coef`)."""
    if decay is None:
        return kl_coef
    start, end, final = decay
    done = min(max(optimizer_steps - start, 0) / (end - start), 1.0)
    return kl_coef + (final - kl_coef) * done


def kl_k3(
    logp_new: torch.Tensor,  # (B, T) policy logprobs of the sampled tokens
    logp_ref: torch.Tensor,  # (B, T) reference logprobs of the same tokens
) -> torch.Tensor:  # (B, T) >= 0
    """Per-token k3 estimate of KL(pi_new || pi_ref): exp(d) - d - 1 with d = logp_ref - logp_new (clamped)."""
    d = (logp_ref.detach() - logp_new).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, T)
    return torch.exp(d) - d - 1.0


def regularizer_loss(
    loss_mask: torch.Tensor,  # (B, T) bool or 0/1: 1 on sampled tokens only
    cfg: RegularizerConfig = RegularizerConfig(),
    entropy: torch.Tensor | None = None,  # (B, T) policy entropy at each position; with grad for a bonus
    logp_new: torch.Tensor | None = None,  # (B, T) policy logprobs, with grad; needed with logp_ref
    logp_ref: torch.Tensor | None = None,  # (B, T) frozen reference logprobs; None = no KL term
    normalizer: float | None = None,  # sampled tokens in the whole optimizer batch; default: this one's
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss term (to add to the policy loss) and this micro-batch's `train/entropy` / `train/kl_ref`."""
    mask = loss_mask.bool()  # (B, T)
    for name, x in (("entropy", entropy), ("logp_new", logp_new), ("logp_ref", logp_ref)):
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"regularizer_loss: {name} {tuple(x.shape)} must match loss_mask {tuple(mask.shape)}")
    if logp_ref is not None and logp_new is None:
        raise ValueError("regularizer_loss: logp_ref needs logp_new")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"regularizer_loss: normalizer must be > 0, got {normalizer}")
    denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
    device = mask.device
    loss = torch.zeros((), device=device)
    metrics: dict[str, float] = {}
    zero = torch.zeros((), device=device)
    if entropy is not None:
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * torch.where(mask, entropy, zero.to(entropy.dtype)).sum() / denom
        metrics["train/entropy"] = float(masked_mean(entropy.detach(), mask))
    if logp_ref is not None:
        k3 = kl_k3(logp_new, logp_ref)  # (B, T)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * torch.where(mask, k3, zero.to(k3.dtype)).sum() / denom
        metrics["train/kl_ref"] = float(masked_mean(k3.detach(), mask))
    return loss, metrics


def top_entropy_mask(
    loss_mask: torch.Tensor,  # (B, T) bool or 0/1: 1 on sampled tokens only
    entropy: torch.Tensor,  # (B, T) policy entropy at each position
    frac: float,  # in (0, 1]: the share of the sampled tokens to keep
) -> torch.Tensor:  # (B, T) bool, a subset of the mask
    """The sampled tokens whose entropy is in the top `frac` of this batch's sampled tokens (`algo.top_entropy_frac`):
    those at or above the (1 - frac) quantile, so ties at the threshold are all kept."""
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"top_entropy_mask: frac must be in (0, 1], got {frac}")
    mask = loss_mask.bool()
    if entropy.shape != mask.shape:
        raise ValueError(f"top_entropy_mask: entropy {tuple(entropy.shape)} must match loss_mask {tuple(mask.shape)}")
    if frac == 1.0 or not bool(mask.any()):
        return mask
    ent = entropy.detach().float()
    threshold = torch.quantile(ent[mask], 1.0 - frac)
    return mask & (ent >= threshold)
