"""Group-normalised advantages for GRPO and GSPO.

Every prompt is sampled ``n`` times (a *group*); each trajectory's advantage is its reward relative to
the other valid members of its group:

    A_i = (r_i - mean_g) / (std_g + eps)        (``scale=True``, GRPO / GSPO)
    A_i =  r_i - mean_g                          (``scale=False``, Dr. GRPO's unscaled baseline)

Choices and departures from the papers, on purpose:

- ``std_g`` is the *sample* standard deviation (Bessel-corrected, ``unbiased=True``). That is what the
  reference implementations compute (``torch.std`` defaults in TRL's and verl's GRPO, which the GSPO
  paper's recipe follows), so advantage magnitudes and the clip ranges tuned against them carry over.
  With groups of 8 the two choices differ by a factor sqrt(8/7) ~ 1.07.
- Failed trajectories (agent or reward raised or timed out) are *not* scored 0: they are excluded from
  their group's mean and std and get advantage 0. Their reward value is never read (it may be NaN).
- A group whose valid rewards are all equal (including a group with fewer than two valid members)
  carries no learning signal; every member gets exactly 0 (detected by comparing the group's min and
  max, so no ``0 / eps`` rounding noise and no NaN).
- ``unanimous="batch"`` (`algo.unanimous_baseline`) gives such a *unanimous* group's valid members the batch's
  baseline instead, REINFORCE++-style: ``(r_i - mean_B) / (std_B + eps)`` over every valid trajectory of the
  batch. Still action-independent, so the gradient stays unbiased; it pushes a board the policy answers the same
  way every time down when that answer scores below the batch, up when above. Groups with signal are unchanged.
  ``unanimous="batch_below"``: the same baseline, but a positive one becomes 0: a unanimous answer is only ever pushed
  down. Raising an answer the policy already gives every time (p ~ 1) does little but sharpen it, and under
  Adam's per-parameter scaling even that small gradient takes full-size steps.
- ``positive_weight`` (`algo.positive_weight`) multiplies the positive advantages, after the baselines, by a weight
  in [0, 1] (W-REINFORCE, Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM
  Reasoning": 0.1; 0 trains on the negative samples only). Raising a sampled answer that the policy already prefers
  is what sharpens it (the entropy falls with the covariance of log-probability and advantage); pushing a worse answer
  down spreads its mass over the others. 1 = off.
"""
from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,  # (N,) float: one scalar reward per trajectory
    group_ids: torch.Tensor,  # (N,) long: trajectories with equal ids share a prompt; any values
    valid: torch.Tensor,  # (N,) bool: False for failed trajectories
    eps: float = 1e-6,
    scale: bool = True,
    unanimous: str = "none",
    positive_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-trajectory advantages ``(N,)`` (float32 or the rewards' float dtype) and metrics.

    ``unanimous``: ``"none"`` (0 for the members of a group without signal), ``"batch"`` (the batch baseline for
    them, see the module docstring) or ``"batch_below"`` (the batch baseline where it is negative, else 0).

    Metrics:
      ``adv/zero_var_group_frac``: fraction of groups that give no learning signal (fewer than two valid
      members, or all valid rewards equal); ``adv/valid_frac``: fraction of valid trajectories;
      ``adv/abs_mean``: mean |A| over valid trajectories; with a batch baseline also ``adv/unanimous_frac``,
      the fraction of valid trajectories that got the batch baseline.
    """
    if unanimous not in ("none", "batch", "batch_below"):
        raise ValueError(f"group_advantages: unanimous must be 'none', 'batch' or 'batch_below', got {unanimous!r}")
    if not 0.0 <= positive_weight <= 1.0:
        raise ValueError(f"group_advantages: positive_weight must be in [0, 1], got {positive_weight}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape or valid.shape != rewards.shape:
        raise ValueError(
            f"group_advantages: rewards {tuple(rewards.shape)}, group_ids {tuple(group_ids.shape)} "
            f"and valid {tuple(valid.shape)} must all be (N,)"
        )
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    n = rewards.shape[0]
    if n == 0:
        empty = {"adv/zero_var_group_frac": 0.0, "adv/valid_frac": 0.0, "adv/abs_mean": 0.0}
        return torch.zeros(0, dtype=dtype, device=rewards.device), empty

    valid = valid.bool()
    # Dense group index 0..G-1, whatever values the caller used as ids.
    _, group = torch.unique(group_ids, return_inverse=True)  # (N,)
    num_groups = int(group.max()) + 1
    r = torch.where(valid, rewards.to(dtype), torch.zeros((), dtype=dtype, device=rewards.device))

    # Phase 1: per-group count and mean over valid members only.
    zeros = torch.zeros(num_groups, dtype=dtype, device=rewards.device)  # (G,)
    count = zeros.index_add(0, group, valid.to(dtype))  # (G,)
    mean = zeros.index_add(0, group, r) / count.clamp(min=1)  # (G,)

    # Phase 2: two-pass sample variance (stable when rewards are large and close together).
    dev = torch.where(valid, r - mean[group], torch.zeros_like(r))  # (N,)
    var = zeros.index_add(0, group, dev * dev) / (count - 1).clamp(min=1)  # (G,)
    std = var.sqrt()  # (G,)

    # Phase 3: groups without signal, found exactly from min == max of the valid rewards.
    inf = torch.tensor(float("inf"), dtype=dtype, device=rewards.device)
    gmax = torch.full_like(zeros, -float("inf")).scatter_reduce(
        0, group, torch.where(valid, r, -inf), reduce="amax"
    )  # (G,)
    gmin = torch.full_like(zeros, float("inf")).scatter_reduce(
        0, group, torch.where(valid, r, inf), reduce="amin"
    )  # (G,)
    no_signal = (count < 2) | (gmax == gmin)  # (G,)

    adv = dev / (std[group] + eps) if scale else dev  # (N,)
    adv = torch.where(valid & ~no_signal[group], adv, torch.zeros_like(adv))

    num_valid = int(valid.sum())
    batch_baseline = valid & no_signal[group]  # (N,) valid members of unanimous groups
    batch = r[valid]  # (num_valid,)
    # a batch whose rewards all agree (or fewer than two valid) has no baseline either
    if unanimous != "none" and bool(batch_baseline.any()) and num_valid >= 2 and batch.max() != batch.min():
        batch_dev = r - batch.mean()  # (N,)
        unan = batch_dev / (batch.std() + eps) if scale else batch_dev  # Bessel-corrected std, as the groups'
        if unanimous == "batch_below":
            unan = unan.clamp(max=0.0)
        adv = torch.where(batch_baseline, unan, adv)
    if positive_weight != 1.0:
        adv = torch.where(adv > 0, adv * positive_weight, adv)
    metrics = {
        "adv/zero_var_group_frac": float(no_signal.to(dtype).mean()),
        "adv/valid_frac": num_valid / n,
        "adv/abs_mean": float(adv[valid].abs().mean()) if num_valid else 0.0,
    }
    if unanimous != "none":
        metrics["adv/unanimous_frac"] = float(batch_baseline.sum()) / max(num_valid, 1)
    return adv, metrics
