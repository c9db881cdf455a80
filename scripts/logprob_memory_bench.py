"""Peak memory and time of the learner's token logprobs, before and after the float32 copy went (torch only).

The learner scores a micro-batch with `rlsys.prefix.plain_token_logprobs` (or its prefix-sharing twin): the model's
(B, T, V) logits, then `rlsys.algos.logprobs.token_logprobs`, which reads them in float32 chunks. Until 2026-12-03
the caller passed `logits[:, :-1].float()`, a float32 copy that autograd kept until backward; at Qwen's vocabulary
(151,936) one 4 x 2,048-token micro-batch made that copy 5 GiB. This script runs both on a stand-in model whose
forward is an embedding and a bf16 LM head of Qwen2.5-0.5B's shape (the part of the learner's memory the change
touches), forward and backward of sum(logprobs) with the entropy metric, alone on the device:

    PYTHONPATH=. python scripts/logprob_memory_bench.py [--batch 4] [--tokens 2048] [--out FILE.json]

Printed per shape: the peak memory above the inputs (GiB), median time (ms), and the largest difference of the
logprobs and of the hidden states' gradient between the two.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from rlsys.algos.logprobs import token_entropy, token_logprobs
from rlsys.prefix import plain_token_logprobs


class LMHeadOnly(torch.nn.Module):
    """input_ids -> logits through an embedding and an untied bf16 LM head; `hidden` keeps its gradient."""

    def __init__(self, vocab: int, hidden: int, device: str):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(0)
        self.embed = torch.randn(vocab, hidden, generator=gen, device=device, dtype=torch.bfloat16)
        self.head = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden, generator=gen, device=device,
                                                          dtype=torch.bfloat16))
        self.hidden = None

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        self.hidden = self.embed[input_ids].requires_grad_(True)  # (B, T, H)
        self.hidden.retain_grad()
        return SimpleNamespace(logits=self.hidden @ self.head.T)  # (B, T, V) bf16


def old_path(model, ids, attn):
    """The learner's call before 2026-12-03: a float32 copy of the shifted logits."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    logp = token_logprobs(logits, ids[:, 1:])
    with torch.no_grad():
        return logp, token_entropy(logits)


def new_path(model, ids, attn):
    return plain_token_logprobs(model, ids, attn, entropy="no_grad")


def measure(fn, model, ids, attn, repeats: int) -> dict:
    times, peak = [], 0
    for _ in range(repeats):
        model.head.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        logp, _ = fn(model, ids, attn)
        logp.sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peak = max(peak, torch.cuda.max_memory_allocated() - base)
    return dict(peak_gib=peak / 2**30, ms=1e3 * statistics.median(times[1:] or times), logp=logp.detach(),
                grad=model.hidden.grad.detach().clone())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = LMHeadOnly(args.vocab, args.hidden, "cuda")
    rows = []
    for tokens in args.tokens:
        ids = torch.randint(0, args.vocab, (args.batch, tokens), device="cuda")
        attn = torch.ones_like(ids)
        old = measure(old_path, model, ids, attn, args.repeats)
        new = measure(new_path, model, ids, attn, args.repeats)
        row = dict(batch=args.batch, tokens=tokens, vocab=args.vocab,
                   logits_gib=args.batch * tokens * args.vocab * 2 / 2**30,
                   old_peak_gib=round(old["peak_gib"], 3), new_peak_gib=round(new["peak_gib"], 3),
                   old_ms=round(old["ms"], 2), new_ms=round(new["ms"], 2),
                   logp_max_diff=float((old["logp"] - new["logp"]).abs().max()),
                   grad_max_diff=float((old["grad"].float() - new["grad"].float()).abs().max()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
