"""The pieces of the transformers generate loop (rlsys/engines/transformers_engine.py) that are not the engine: a KV
cache that grows in place, per-row sampling with each request's own generator, OpenAI's penalties and logit bias, and
stop strings. rlsys/engines/cpu_decode.py's loop reproduces `sample_rows` and `adjusted_logits` row for row."""
from __future__ import annotations

import functools

import torch

from rlsys.engines.base import SamplingParams


def growing_cache(config, capacity: int):
    """A ``DynamicCache`` whose full-attention layers append in place (``_growing_layer_class``); models with
    other layer kinds (sliding windows, linear attention) keep transformers' own layers."""
    from transformers import DynamicCache  # noqa: PLC0415
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [_growing_layer_class()(capacity) for _ in cache.layers]
    return cache


@functools.cache
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415 (heavy import, only when built)

    class GrowingLayer(DynamicLayer):
        """DynamicLayer that writes new keys/values into a buffer with room for ``capacity`` positions and
        returns views of its filled part, instead of ``torch.cat``-ing the whole cache at every decode step
        (40% of the recipe's decode time). Rows dropped by ``batch_select_indices`` leave a compact tensor;
        the next update copies it into a fresh buffer."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self._key_buf: torch.Tensor | None = None  # (B, H, capacity, D)
            self._value_buf: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            filled = self.keys.shape[-2] if self.keys.numel() else 0
            need = filled + key_states.shape[-2]
            buf = self._key_buf
            if (buf is None or need > buf.shape[-2] or buf.shape[0] != key_states.shape[0]
                    or (filled and self.keys.data_ptr() != buf.data_ptr())):  # first, full, or rows selected
                b, h, _, dk = key_states.shape
                room = max(need, self.capacity)
                key_buf = key_states.new_empty((b, h, room, dk))
                value_buf = value_states.new_empty((b, h, room, value_states.shape[-1]))
                if filled:
                    key_buf[:, :, :filled] = self.keys
                    value_buf[:, :, :filled] = self.values
                self._key_buf, self._value_buf = key_buf, value_buf
            self._key_buf[:, :, filled:need] = key_states
            self._value_buf[:, :, filled:need] = value_states
            self.keys, self.values = self._key_buf[:, :, :need], self._value_buf[:, :, :need]
            return self.keys, self.values

    return GrowingLayer


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
    """One token per row of ``logits`` (b, V) as a (b,) long tensor: greedy at temperature 0, else
    temperature + top-p, each row with its own ``params`` and generator.

    Inverse-CDF sampling with one uniform from the row's own generator, so the stream of uniforms
    depends only on the seed and the number of tokens sampled so far. Rows that share (temperature,
    top_p) are sampled together; the CDF is over the vocabulary in id order without top-p and in
    descending probability with it.
    """
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # (b,)
    by_setting: dict[tuple[float, float], list[int]] = {}
    for row, p in enumerate(params):
        by_setting.setdefault((0.0 if p.greedy else p.temperature, p.top_p), []).append(row)
    for (temperature, top_p), rows in by_setting.items():
        idx_rows = torch.tensor(rows, device=logits.device)
        sub = logits[idx_rows].float()  # (k, V)
        if temperature == 0:
            out[idx_rows] = sub.argmax(dim=-1)
            continue
        probs = torch.softmax(sub / temperature, dim=-1)  # (k, V)
        ids = None
        if top_p < 1.0:
            probs, ids = probs.sort(dim=-1, descending=True, stable=True)
            mass_before = probs.cumsum(-1) - probs
            probs = probs * (mass_before < top_p)  # smallest prefix reaching top_p; first kept
        cdf = probs.cumsum(-1)  # (k, V)
        u = torch.stack([torch.rand((), generator=generators[r]) for r in rows])  # (k,) one uniform a row
        target = (u.double() * cdf[:, -1].double()).float().unsqueeze(1)  # (k, 1)
        idx = torch.searchsorted(cdf, target, right=True).squeeze(1)  # (k,)
        vocab = cdf.shape[-1]
        last_nonzero = ((probs > 0) * torch.arange(vocab, device=probs.device)).argmax(-1)  # (k,)
        picked = probs.gather(1, idx.clamp(max=vocab - 1).unsqueeze(1)).squeeze(1)
        # u * total rounded onto the top: the last nonzero entry
        idx = torch.where((idx >= vocab) | (picked <= 0), last_nonzero, idx)
        out[idx_rows] = ids.gather(1, idx.unsqueeze(1)).squeeze(1) if ids is not None else idx
    return out


def adjusted_logits(logits: torch.Tensor, params: list[SamplingParams], counts: list[torch.Tensor | None]):
    """``logits`` (b, V) with each row's penalties and logit bias applied (a copy; the input when none has any)."""
    if not any(p.adjusts_logits for p in params):
        return logits
    out = logits.float().clone()  # (b, V)
    for row, (p, count) in enumerate(zip(params, counts)):
        if not p.adjusts_logits:
            continue
        out[row] -= p.frequency_penalty * count + p.presence_penalty * (count > 0).float()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=out.device)
            out[row, ids] += torch.tensor([b for _, b in p.logit_bias], device=out.device)
    return out


class StopText:
    """Whether a request's generated tokens just completed one of its stop strings.

    Only a tail of the tokens is decoded at each step: a stop string of L characters spans at most 4 * L tokens
    (a character can take up to 4 byte tokens), plus one token before it so that the tail's first character
    is decoded as in the full text (byte tokens cut mid-character, a tokenizer's leading-space rules)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.window = 4 * max(len(s) for s in stop) + 1

    def completed(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-self.window:], skip_special_tokens=False)
        return any(s in tail for s in self.stop)
