"""Where does a checkpoint put its square probability on the held-out boards? (docs/results-cpu.md, short-run study)

For each of the job's 256 held-out boards (data seed 2026, disjoint from the 2048 training boards), feed the
prompt plus the canonical call prefix `<tool_call>\n{"name": "choose_square", "arguments": {"square": ` and read
the next-token distribution over the digits 1-9 (raw, T=1). Prints per checkpoint: legal mass (probability on
free squares, the probe's smooth legality measure), greedy legal rate, the share of boards whose greedy square is
the most common one (1.0 = a board-independent answer), the mean entropy over the nine squares (nats; ln 9 =
2.20), and the best legal mass any board-independent distribution could reach (always the most-often-free square).

    .venv/bin/python scripts/square_mass.py CKPT [CKPT ...]
"""
import math, sys
from collections import Counter
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jobs.items import load_eval_items
from rlsys.config import load_config
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for

PREFIX = '<tool_call>\n{"name": "choose_square", "arguments": {"square": '


def main():
    torch.set_num_threads(1)
    cfg = load_config()
    # the job's held-out boards, as the in-job eval builds them
    held = load_eval_items(cfg.data, cfg.algo.name, cfg.env.environment())
    for ckpt in sys.argv[1:]:
        tok = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        digits = [tok.convert_tokens_to_ids(str(d)) for d in range(1, 10)]
        mass, glegal, ent, greedy = 0.0, 0, 0.0, []
        free_count = Counter()
        for item in held:
            text = tok.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                           add_generation_prompt=True, tokenize=False) + PREFIX
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1].float()
            p_all = torch.softmax(logits, -1)
            p = p_all[digits]
            q = p / p.sum()
            legal = set(item["legal_moves"])
            free_count.update(legal)
            mass += float(sum(p[s - 1] for s in legal))
            g = int(torch.argmax(p)) + 1
            greedy.append(g)
            glegal += g in legal
            ent += float(-(q * q.clamp_min(1e-12).log()).sum())
        n = len(held)
        top, top_n = Counter(greedy).most_common(1)[0]
        best_sq, best_free = free_count.most_common(1)[0]
        print(f"{ckpt}: legal_mass {mass/n:.3f} greedy_legal {glegal/n:.3f} greedy_top_square {top} "
              f"({top_n/n:.2f} of boards) entropy {ent/n:.2f} | best board-independent: square {best_sq} "
              f"free on {best_free/n:.3f}")


if __name__ == "__main__":
    main()
