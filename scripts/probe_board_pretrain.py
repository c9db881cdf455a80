"""A board-reading warm start for the legality probe (issue 22): pretrain a probe model's initial weights as a
language model on the training boards' prompts alone (next-token loss over the whole chat up to the answer's
digit, never the digit: no move, no reward, nothing of which squares are free beyond what the prompt shows), and save
them as a folder that `legality_probe.py --init` reads. The question it answers: does a model that has learned to
predict the drawn boards' cells (which needs their positions) leave the GSPO plateau sooner?

    .venv/bin/python scripts/legality_probe.py --export probe.pt
    .venv/bin/python scripts/probe_board_pretrain.py --data probe.pt --size h16 --steps 600 --out lm
    .venv/bin/python scripts/legality_probe.py --data probe.pt --size h16 --init lm --boards 8 --samples 8 \
        --lr 3e-4 --temp 1.0 --top-p 0.9 --steps 300 --seed 0

Printed: the LM loss over the board tokens (the user message) and over the rest, every 100 steps.
"""
import argparse
import os
import random
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from legality_probe import Qwen2, pad  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", default="h16")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from safetensors.torch import save_file

    data = torch.load(a.data, weights_only=False)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    m = Qwen2(data["configs"][a.size], data["weights"][a.size])
    prompts = [b["ids"] for b in data["train"]]  # the held-out boards stay unseen
    # the positions where prompts differ from one another: the board (everything else is the same text)
    first = min(next(i for i, (x, y) in enumerate(zip(p, prompts[0])) if x != y)
                for p in prompts[1:] if p != prompts[0])
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0)
    for step in range(a.steps):
        x, last = pad(rng.sample(prompts, a.batch), "cpu")
        logits = m(x)[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                              reduction="none").view(x.shape[0], -1)
        pos = torch.arange(x.shape[1] - 1)[None]
        valid = pos < last[:, None]  # the pad positions after each prompt predict nothing
        board = valid & (pos >= first - 1)
        loss = nll[valid].mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step} loss {loss.item():.3f} board {nll[board].mean().item():.3f} "
                  f"rest {nll[valid & ~board].mean().item():.3f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    save_file({k.replace("__", "."): v.detach().contiguous() for k, v in m.p.items()}, f"{a.out}/model.safetensors")
    print(f"wrote {a.out}/model.safetensors")


if __name__ == "__main__":
    main()
