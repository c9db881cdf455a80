"""A generic-copying warm start for the legality probe (issue 22): pretrain a probe model's initial weights on
induction sequences (random tokens of the tiny vocabulary, then the same tokens again; next-token loss on the
repeat), nothing of tic-tac-toe, and save them as a folder that `legality_probe.py --init` reads.

    .venv/bin/python scripts/legality_probe.py --export probe.pt
    .venv/bin/python scripts/probe_induction_init.py --data probe.pt --size h16 --steps 2500 --lr 2e-3 --out ind
    .venv/bin/python scripts/legality_probe.py --data probe.pt --size h16 --init ind --boards 8 --samples 8 \
        --lr 3e-4 --temp 1.0 --top-p 0.9 --steps 300 --seed 0

Measured on the 2-core box (docs/results-cpu.md, "Why these settings", 8): it made the probe worse.
"""
import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from legality_probe import Qwen2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True); ap.add_argument("--size", default="h16")
    ap.add_argument("--steps", type=int, default=2500); ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=32); ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from safetensors.torch import save_file

    data = torch.load(a.data, weights_only=False)
    torch.manual_seed(0)
    rng = random.Random(0)
    m = Qwen2(data["configs"][a.size], data["weights"][a.size])
    vocab = m.w("model.embed_tokens.weight").shape[0]
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0)
    for step in range(a.steps):
        n = rng.randint(8, 24)
        x = torch.randint(3, vocab, (a.batch, n))
        ids = torch.cat([x, x], 1)  # (B, 2n): the second half repeats the first
        logits = m(ids)[:, n - 1 : -1]  # (B, n, V): the predictions of the repeat
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, n:].reshape(-1))
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
        if step % 250 == 0 or step == a.steps - 1:
            print(f"step {step} repeat loss {loss.item():.3f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    save_file({k.replace("__", "."): v.detach().contiguous() for k, v in m.p.items()}, f"{a.out}/model.safetensors")
    print(f"wrote {a.out}/model.safetensors")


if __name__ == "__main__":
    main()
