"""Per-token log-probabilities of given targets, per-token entropies, and a masked mean.

Shift convention: the caller shifts. ``logits[:, t]`` is the distribution that *predicts*
``target_ids[:, t]``; for a causal LM over ``input_ids`` (B, L) that means
``logits = model(input_ids).logits[:, :-1]`` and ``target_ids = input_ids[:, 1:]`` (and the loss mask
is shifted the same way: ``loss_mask[:, 1:]``). Nothing in this module shifts again.

Memory: ``log_softmax(logits.float())`` would materialise a (B, T, V) float32 copy, and autograd would
keep it (plus the temperature-scaled copy) alive until backward: ~4.6 GiB at B*T=8k, V=150k. Here a
small autograd Function walks the rows in chunks of about ``_CHUNK_BYTES`` of float32, keeps only the
per-row logsumexp (B*T floats) for backward, and recomputes the softmax chunk by chunk in backward.
The only full-size buffer is the gradient itself, in the logits' dtype. Computation is float32 (float64
if the logits are float64), whatever the logits' dtype.

Temperature: ``log softmax(logits / temperature)``, the distribution the engine sampled from. Match it to
what the engine reports: vLLM returns *raw* (temperature-free) logprobs unless ``logprobs_mode`` is set
to ``processed_logprobs``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

_CHUNK_BYTES = 1 << 28  # ~256 MiB of float32 working set per chunk


def _scaled_chunks(logits: torch.Tensor, chunk_rows: int, dtype: torch.dtype, temperature: float):
    """(start, end, x) over chunks of the rows of logits (R, V): x = logits[start:end] / temperature in ``dtype``,
    (r, V). x may alias logits (no cast, temperature 1): callers make no in-place ops on it."""
    for start in range(0, logits.shape[0], chunk_rows):
        end = min(start + chunk_rows, logits.shape[0])
        x = logits[start:end].to(dtype)
        yield start, end, (x / temperature if temperature != 1.0 else x)


def _chunked_rows(ctx: Any, logits: torch.Tensor, temperature: float, chunk_rows: int,
                  row_value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass both Functions share: ``row_value(start, end, x, lse)`` (r,) of every chunk of rows (x the
    scaled chunk (r, V), lse its (r,) logsumexp) into one (R,) tensor, and every row's logsumexp (R,), both float32
    or wider; the temperature and chunk size go on ``ctx`` for backward."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=compute_dtype, device=logits.device)  # (R,)
    lse = torch.empty(rows, dtype=compute_dtype, device=logits.device)  # (R,)
    for start, end, x in _scaled_chunks(logits, chunk_rows, compute_dtype, temperature):  # x (r, V)
        chunk_lse = torch.logsumexp(x, dim=-1)  # (r,)
        out[start:end] = row_value(start, end, x, chunk_lse)
        lse[start:end] = chunk_lse
    ctx.temperature = temperature
    ctx.chunk_rows = chunk_rows
    return out, lse


def _chunked_grad(ctx: Any, logits: torch.Tensor, lse: torch.Tensor, chunk_grad: Any) -> torch.Tensor:
    """The backward pass both Functions share: (R, V) in the logits' dtype, filled chunk by chunk of rows with
    ``chunk_grad(start, end, x)`` (r, V), x the scaled chunk recomputed in ``lse``'s dtype."""
    grad = torch.empty_like(logits)  # (R, V)
    for start, end, x in _scaled_chunks(logits, ctx.chunk_rows, lse.dtype, ctx.temperature):  # x (r, V)
        grad[start:end] = chunk_grad(start, end, x)
    return grad


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(x / temperature)[target] row by row; x (R, V), target (R,) -> (R,)."""

    @staticmethod
    def forward(ctx, logits, target_ids, temperature, chunk_rows):  # (R, V), (R,), float, int
        out, lse = _chunked_rows(ctx, logits, temperature, chunk_rows,
                                 lambda start, end, x, lse: x.gather(1, target_ids[start:end, None]).squeeze(1) - lse)
        ctx.save_for_backward(logits, target_ids, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # (R,)
        logits, target_ids, lse = ctx.saved_tensors

        def chunk_grad(start: int, end: int, x: torch.Tensor) -> torch.Tensor:  # x (r, V)
            # d/dx_v log p(target) = (1[v == target] - softmax(x)_v) / temperature
            g = (grad_out[start:end].to(lse.dtype) / ctx.temperature)[:, None]  # (r, 1)
            out = torch.exp(x - lse[start:end, None])  # (r, V), a fresh tensor
            out.mul_(-g)
            return out.scatter_add_(1, target_ids[start:end, None], g)

        return _chunked_grad(ctx, logits, lse, chunk_grad), None, None, None


def token_logprobs(
    logits: torch.Tensor,  # (B, T, V) already shifted: logits[:, t] predicts target_ids[:, t]
    target_ids: torch.Tensor,  # (B, T) long, every id in [0, V) (put any valid id on padding)
    temperature: float = 1.0,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:  # (B, T) float32 (float64 for float64 logits)
    """``log_softmax(logits / temperature).gather(-1, target_ids)`` without a full float32 copy.

    Differentiable with respect to ``logits`` (once). ``chunk_rows`` overrides how many of the B*T
    rows are processed at a time (default: ~256 MiB of float32 per chunk).
    """
    if logits.dim() != 3 or target_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs: logits {tuple(logits.shape)} must be (B, T, V) and "
            f"target_ids {tuple(target_ids.shape)} must be (B, T)"
        )
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    batch, steps, vocab = logits.shape
    rows = chunk_rows if chunk_rows is not None else max(1, _CHUNK_BYTES // (4 * max(vocab, 1)))
    flat = _TargetLogprob.apply(
        logits.reshape(batch * steps, vocab),
        target_ids.reshape(batch * steps).long(),
        float(temperature),
        int(rows),
    )  # (B*T,)
    return flat.view(batch, steps)


class _TokenEntropy(torch.autograd.Function):
    """Entropy of softmax(x / temperature) row by row; x (R, V) -> (R,)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_rows):  # (R, V), float, int
        # H = lse - sum_v p_v x_v, with p = exp(x - lse) (r, V)
        out, lse = _chunked_rows(ctx, logits, temperature, chunk_rows,
                                 lambda start, end, x, lse: lse - (torch.exp(x - lse[:, None]) * x).sum(-1))
        ctx.save_for_backward(logits, lse, out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # (R,)
        logits, lse, entropy = ctx.saved_tensors

        def chunk_grad(start: int, end: int, x: torch.Tensor) -> torch.Tensor:  # x (r, V)
            # d/dx_v H = -p_v (log p_v + H) / temperature
            log_p = x - lse[start:end, None]  # (r, V), a fresh tensor
            out = torch.exp(log_p) * (log_p + entropy[start:end, None])
            return out.mul_((-grad_out[start:end].to(lse.dtype) / ctx.temperature)[:, None])

        return _chunked_grad(ctx, logits, lse, chunk_grad), None, None


def token_entropy(
    logits: torch.Tensor,  # (B, T, V) any float dtype
    temperature: float = 1.0,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:  # (B, T) float32 (float64 for float64 logits), in nats
    """Entropy of ``softmax(logits / temperature)`` at every position, without a full float32 copy.

    Chunked like ``token_logprobs``: keeps only the per-row logsumexp and entropy for backward and
    recomputes the softmax there. Differentiable with respect to ``logits`` (once), for an entropy
    bonus; under ``torch.no_grad`` it is a read-only pass over the logits.
    """
    if logits.dim() != 3:
        raise ValueError(f"token_entropy: logits {tuple(logits.shape)} must be (B, T, V)")
    if temperature <= 0:
        raise ValueError(f"token_entropy: temperature must be > 0, got {temperature}")
    batch, steps, vocab = logits.shape
    rows = chunk_rows if chunk_rows is not None else max(1, _CHUNK_BYTES // (4 * max(vocab, 1)))
    flat = _TokenEntropy.apply(logits.reshape(batch * steps, vocab), float(temperature), int(rows))  # (B*T,)
    return flat.view(batch, steps)


def masked_mean(
    x: torch.Tensor,  # any shape
    mask: torch.Tensor,  # bool or 0/1, broadcastable to x; positions where it is 0 are ignored
    dim: int | None = None,
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is set; 0 where nothing is set.

    Masked-out values never reach the result or its gradient, even if they are inf or NaN.
    """
    m = mask.bool().expand_as(x)
    total = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return total.sum() / m.sum().clamp(min=1)
    return total.sum(dim) / m.sum(dim).clamp(min=1)


def check_policy_loss_inputs(
    loss: str,
    logp_new: torch.Tensor,  # (B, T)
    logp_old: torch.Tensor,  # (B, T)
    advantages: torch.Tensor,  # (B,)
    loss_mask: torch.Tensor,  # (B, T)
    normalizer: float | None,
) -> None:
    """The shape and normaliser checks every policy loss starts with; ValueError names ``loss``."""
    if logp_old.shape != logp_new.shape or loss_mask.shape != logp_new.shape:
        raise ValueError(
            f"{loss}: logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must all be (B, T)"
        )
    if advantages.shape != logp_new.shape[:1]:
        raise ValueError(f"{loss}: advantages {tuple(advantages.shape)} must be (B,)")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"{loss}: normalizer must be > 0, got {normalizer}")


def clip_metrics(
    loss_sum: torch.Tensor,  # () the objective summed over ``valid`` units, before the normalizer
    ratio: torch.Tensor,  # (B, T) per token (GRPO) or (B,) per sequence (GSPO)
    adv: torch.Tensor,  # broadcastable to ``ratio``: (B, 1) or (B,)
    valid: torch.Tensor,  # bool, ``ratio``'s shape: the units that count
    clip_eps_low: float,
    clip_eps_high: float,
    logp_old: torch.Tensor,  # (B, T)
    logp_new: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T) bool
    logp_rollout: torch.Tensor | None,  # (B, T) or None
) -> dict[str, float]:
    """The clipped policy losses' shared metrics over one micro-batch, per unit (token or sequence): the loss's
    mean, the ratio's mean and spread, how often each side of the clip bit, and the learner's (and, decoupled, the
    engine's) logprob gap to the sampling policy, per token. Call under ``torch.no_grad()``."""
    n = max(int(valid.sum()), 1)
    r = ratio[valid]
    low = (adv < 0) & (ratio < 1.0 - clip_eps_low) & valid
    high = (adv > 0) & (ratio > 1.0 + clip_eps_high) & valid
    metrics = {
        "train/pg_loss": float(loss_sum) / n,  # micro-batch mean, whatever the normalizer
        "train/ratio_mean": float(r.mean()) if r.numel() else 0.0,
        "train/ratio_std": float(r.std(unbiased=False)) if r.numel() else 0.0,
        "train/clip_frac_low": int(low.sum()) / n,
        "train/clip_frac_high": int(high.sum()) / n,
        "train/clip_frac": int((low | high).sum()) / n,
        "train/logp_diff_mean": float(masked_mean((logp_old - logp_new).abs(), mask)),
    }
    if logp_rollout is not None:
        # The stale-weights alarm in decoupled mode: engine vs learner on the same tokens.
        diff = (logp_old - logp_rollout).abs()
        metrics["train/rollout_logp_diff_mean"] = float(masked_mean(diff, mask))
    return metrics


def reduce_policy_loss(
    unit_loss: torch.Tensor,  # (B, T) per token (GRPO) or (B,) per sequence (GSPO)
    valid: torch.Tensor,  # bool, ``unit_loss``'s shape: the units that count
    normalizer: float | None,
    cfg: Any,  # GRPOConfig or GSPOConfig: the clip range
    ratio: torch.Tensor,  # ``unit_loss``'s shape
    adv: torch.Tensor,  # broadcastable to ``ratio``
    logp_old: torch.Tensor,  # (B, T)
    logp_new: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T) bool
    logp_rollout: torch.Tensor | None,  # (B, T) or None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy losses' last phase: ``unit_loss`` summed over the ``valid`` units, divided by
    ``normalizer`` (default: how many units are valid, at least 1), and their shared metrics (`clip_metrics`)."""
    unit_loss = torch.where(valid, unit_loss, torch.zeros((), dtype=unit_loss.dtype, device=unit_loss.device))
    denom = normalizer if normalizer is not None else valid.sum().clamp(min=1)
    loss = unit_loss.sum() / denom
    with torch.no_grad():
        metrics = clip_metrics(unit_loss.sum(), ratio, adv, valid, cfg.clip_eps_low, cfg.clip_eps_high, logp_old,
                               logp_new, mask, logp_rollout)
    return loss, metrics


def check_clip_config(cfg: Any) -> None:
    """The checks of a clipped policy loss's config (GRPOConfig, GSPOConfig); ValueError names its class."""
    name = type(cfg).__name__
    if not (0.0 <= cfg.clip_eps_low < 1.0 and cfg.clip_eps_high >= 0.0):
        raise ValueError(f"{name}: need 0 <= clip_eps_low < 1 and clip_eps_high >= 0: {cfg}")
    if cfg.tis_cap is not None and cfg.tis_cap <= 0.0:
        raise ValueError(f"{name}: tis_cap must be > 0 or None, got {cfg.tis_cap}")
