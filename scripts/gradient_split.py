"""How much of a GSPO gradient comes from the square token, and how much from the ~19 format tokens?

Tests the hypothesis of docs/results-cpu.md (the format tokens dilute the decision token's signal) on a real
checkpoint, without Ray: sample `--samples` answers for `--boards` training boards at the job's sampling
settings (transformers generate, T and top-p as the proxy applies them), score them with the job's reward,
form the job's group advantages, and split the GSPO gradient (n_minibatches = 1: sequence REINFORCE,
loss = -mean_i A_i * mean_t logp(y_i,t)) into the part from the square digit token and the part from every other
sampled token. Prints, per batch: norms of both parts, their cosine with the full gradient, the fraction of
parameters whose gradient sign is set by the format part, and the same for the Adam-normalised update
direction (sign, roughly what Adam does in its first steps).

    .venv/bin/python scripts/gradient_split.py --ckpt /tmp/ttt-study/sft/checkpoints/step_000100 --batches 3
"""
import argparse, json, math
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsys.algos import group_advantages
from jobs.items import load_items
from rlsys.config import load_config
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for
from rlsys.envs.tictactoe.reward import reward
from rlsys.proxy.toolcalls import parse_tool_calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--boards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temp", type=float, default=1.3)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    cfg = load_config()
    items = load_items(cfg.data, cfg.algo.name, cfg.env.environment())  # the job's training boards
    digit_ids = {tok.convert_tokens_to_ids(str(d)) for d in range(1, 10)}
    for b in range(a.batches):
        batch = items[b * a.boards:(b + 1) * a.boards]
        seqs, rewards, groups, sq_pos, plen = [], [], [], [], []
        for g, item in enumerate(batch):
            text = tok.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids.repeat(a.samples, 1), do_sample=True, temperature=a.temp, top_p=a.top_p,
                                     top_k=0, max_new_tokens=24, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                                     pad_token_id=tok.pad_token_id)
            for row in out:
                comp = row[ids.shape[1]:].tolist()
                if tok.convert_tokens_to_ids("<|im_end|>") in comp:
                    comp = comp[:comp.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1]
                comp = [t for t in comp if t != tok.pad_token_id] or comp[:1]
                s = tok.decode(comp, skip_special_tokens=True)
                parsed = parse_tool_calls(s, ["choose_square"])
                output = {"content": parsed.content or None,
                          "tool_calls": [{"name": c.name, "arguments": json.dumps(c.arguments)} for c in parsed.calls]}
                r = reward({"item": item, "output": output})
                # the square token: first digit token after the text '"square":' in the completion
                pos = None
                for j in range(len(comp)):
                    if comp[j] in digit_ids and '"square":' in tok.decode(comp[:j]):
                        pos = j; break
                seqs.append(ids[0].tolist() + comp); plen.append(ids.shape[1]); sq_pos.append(pos)
                rewards.append(r); groups.append(g)
        R = torch.tensor(rewards); G = torch.tensor(groups)
        adv, am = group_advantages(R, G, torch.ones(len(R), dtype=torch.bool))
        N = len(seqs)
        grads = {}
        for part in ("full", "square"):
            model.zero_grad()
            for i in range(N):
                if adv[i] == 0:
                    continue
                x = torch.tensor([seqs[i]])
                logits = model(input_ids=x).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
                lp = lp[plen[i] - 1:]  # the sampled tokens
                L = lp.shape[0]
                if part == "full":
                    term = lp.sum() / L
                else:
                    if sq_pos[i] is None:
                        continue
                    term = lp[sq_pos[i]] / L
                (-(adv[i] * term) / N).backward()
            grads[part] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().clone()
                                     for _, p in params])
        gf, gs = grads["full"], grads["square"]
        go = gf - gs
        cos = lambda u, v: float(u @ v / (u.norm() * v.norm() + 1e-30))
        nz = gf.abs() > 0
        fmt_dominant = float(((go.abs() > gs.abs()) & nz).sum() / nz.sum())
        sign_agree = float(((torch.sign(gf) == torch.sign(gs)) & nz).sum() / nz.sum())
        # per tensor: where is the format part larger
        per = []
        off = 0
        for n, p in params:
            k = p.numel(); s, o = gs[off:off + k], go[off:off + k]; off += k
            per.append((n, float(o.norm() / (s.norm() + 1e-30))))
        per.sort(key=lambda t: -t[1])
        n_sq = sum(1 for p in sq_pos if p is not None)
        print(json.dumps({
            "batch": b, "episodes": N, "reward_mean": round(float(R.mean()), 3),
            "zero_var_group_frac": am["adv/zero_var_group_frac"], "with_square_token": n_sq,
            "mean_len": round(sum(len(s) - p for s, p in zip(seqs, plen)) / N, 1),
            "norm_full": float(gf.norm()), "norm_square": float(gs.norm()), "norm_format": float(go.norm()),
            "cos_full_square": round(cos(gf, gs), 3), "cos_full_format": round(cos(gf, go), 3),
            "cos_square_format": round(cos(gs, go), 3),
            "frac_params_format_larger": round(fmt_dominant, 3),
            "frac_params_sign_full_eq_square": round(sign_agree, 3),
            "format_over_square_norm_top5": [(n, round(v, 2)) for n, v in per[:5]],
            "format_over_square_norm_bottom3": [(n, round(v, 2)) for n, v in per[-3:]],
        }))


if __name__ == "__main__":
    main()
