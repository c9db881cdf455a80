"""Does the learner's attention backward give NaN gradients on this GPU? A probe of the gsm runs' skipped steps.

The gsm runs on the H200 (torch 2.11) skipped about one step in seven for a NaN gradient norm with a finite loss.
pytorch/pytorch#196678 describes a cuDNN scaled-dot-product-attention backward that returns NaN query gradients
when an explicit mask is passed, the key length is 64 mod 128 and a row's logsumexp is below ln(float32 max), as
in Qwen2.5's massive-activation heads. Two checks, each with PyTorch's cuDNN attention kernel allowed and not
(`learner.cudnn_attention`):

1. attention alone: q and k whose scores are all about -120, a causal boolean mask, lengths 640, 704 and 768:
   how many elements of grad_q are not finite;
2. the model (`--model`, e.g. the folder rlsys converts Qwen2.5-Coder-0.5B's GGUF into): right-padded micro-batches
   of 4 rows, the longest T tokens (T from 256 to 1088 in steps of 32), the plain path's token logprobs of each
   row's second half (what the learner trains on), backward: how many parameter tensors get a non-finite gradient.

    python scripts/probe_sdpa_nan.py --model /path/to/qwen-folder --out probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def attention_alone(torch, lengths: list[int], d: int = 64) -> list[dict]:
    import torch.nn.functional as F

    out = []
    for n in lengths:
        g = torch.Generator(device="cuda").manual_seed(n)
        q = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        k = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
        v = torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        q[..., 0] = 1.0
        k[..., 0] = -120.0 * math.sqrt(d)  # every score ~ -120: every row's logsumexp < -88.7
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()[None, None]  # (1, 1, n, n)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o.backward(torch.randn(o.shape, device="cuda", dtype=o.dtype, generator=g))
        out.append({"check": "attention", "length": n, "grad_q_nonfinite": int((~torch.isfinite(q.grad)).sum()),
                    "grad_k_nonfinite": int((~torch.isfinite(k.grad)).sum()),
                    "out_nonfinite": int((~torch.isfinite(o)).sum())})
    return out


def model_batches(torch, model, vocab: int, lengths: list[int]) -> list[dict]:
    from rlsys.algos import masked_mean
    from rlsys.prefix import plain_token_logprobs

    out = []
    for T in lengths:
        g = torch.Generator().manual_seed(T)
        rows = [T, T - 13, T - 27, T - 40]  # right-padded: the model gets an explicit attention mask
        ids = torch.randint(3, vocab, (len(rows), T), generator=g)
        attn = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T)
        for i, n in enumerate(rows):
            attn[i, :n] = 1
            mask[i, n // 2 : n] = 1
        ids, attn, mask = ids.cuda(), attn.cuda(), mask.cuda()
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logp = plain_token_logprobs(model, ids, attn)  # (B, T-1)
        loss = -masked_mean(logp, mask[:, 1:])
        loss.backward()
        torch.cuda.synchronize()
        bad = [name for name, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        out.append({"check": "model", "length": T, "length_mod_128": T % 128, "loss": float(loss),
                    "params_nonfinite": len(bad), "first_nonfinite": bad[:3], "seconds": time.perf_counter() - t})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face folder (or anything rlsys.models.resolve takes)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_sdpa_nan: needs CUDA", file=sys.stderr)
        return 2
    rows: list[dict] = [{"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                         "device": torch.cuda.get_device_name()}]
    model = vocab = None
    if args.model:
        from transformers import AutoModelForCausalLM

        from rlsys.models.resolve import resolve_model

        path = resolve_model(args.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        model.train()
        vocab = model.config.vocab_size
        rows[0]["model"] = str(path)
        rows[0]["attn_implementation"] = model.config._attn_implementation
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        found = attention_alone(torch, [640, 704, 768])
        if model is not None:
            found += model_batches(torch, model, vocab, list(range(256, 1089, 32)))
        for r in found:
            r["cudnn_sdp"] = cudnn
            print(json.dumps(r), flush=True)
        rows += found
    with open(args.out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
