"""Legality probe: a fast stand-in for the GSPO stage of configs/recipes/tictactoe-tiny.toml, for sweeps.

Two steps (docs/results-cpu.md, "Why these settings"):

    # here (needs rlsys): tokenised boards, SFT chats and initial weights of a few tiny-model shapes
    .venv/bin/python scripts/legality_probe.py --export probe.pt
    # anywhere with torch (a GPU box is fastest): format SFT, then GSPO on the decision token
    python scripts/legality_probe.py --data probe.pt --size h16 --boards 8 --samples 8 --lr 3e-4 --temp 1.3 --top-p 0.9 --steps 300
    python scripts/legality_probe.py --data probe.pt --sweep runs.json     # a JSON list of argument dicts

The model is a pure-torch copy of the tiny Qwen2 (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings; its logits equal
transformers' on the same weights). After the same format SFT as the job (sft_data.py chats, 16 a step, lr 3e-3,
warm-up 10, cosine), each step samples `samples` answers for `boards` training boards at the position of the square
digit (after `{"square": `), scores them with the reward table (-1 for a non-digit or occupied square), and takes
one AdamW step on the group-normalised REINFORCE loss, which is what GSPO is with one optimizer step per batch.
It leaves out the ~20 format tokens (so temperature's effect on the format is measured in the job, not here).
Printed per run: greedy legal/optimal rate, legal mass and entropy over the nine squares, on the job's 256
held-out boards, every `--every` steps. One JSON line per run.
"""
import argparse, copy, json, math, random, sys, time
import torch, torch.nn.functional as F


SIZES = {
    "tiny": {}, "h8": {"num_heads": 8, "num_kv_heads": 4}, "h16": {"num_heads": 16, "num_kv_heads": 8},
    "l2h8": {"num_layers": 2, "num_heads": 8, "num_kv_heads": 4}, "l1h16": {"num_layers": 1, "num_heads": 16, "num_kv_heads": 8},
    "l2h16": {"num_layers": 2, "num_heads": 16, "num_kv_heads": 8},
}


def export(path, board_cells=False):
    """Tokenised train/held-out boards (the job's seeds), SFT chats and initial weights of SIZES, for --data.
    `board_cells`: every size with the tokenizer that draws each board cell as one token (tiny-cells)."""
    from rlsys.envs.tictactoe import game
    from rlsys.envs.tictactoe.dataset import make_dataset
    from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for
    from rlsys.envs.tictactoe.sft_data import make_sft_dataset
    from rlsys.models.tiny import create_tiny_model
    from rlsys.sft import render_chat

    out = {"weights": {}, "configs": {}}
    for name, sizes in SIZES.items():
        m, tok = create_tiny_model(seed=0, board_cells=board_cells, **sizes)
        out["weights"][name] = {k: v.clone() for k, v in m.state_dict().items()}
        c = m.config
        out["configs"][name] = dict(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                                    kv=c.num_key_value_heads, inter=c.intermediate_size, vocab=c.vocab_size,
                                    theta=10000.0, eps=c.rms_norm_eps)
    train = make_dataset(2048, 2026)
    held = make_dataset(256, 2027, exclude=[b["board"] for b in train])

    def prompt_ids(board):
        text = tok.apply_chat_template(messages_for(board), tools=[CHOOSE_SQUARE_TOOL], add_generation_prompt=True,
                                       tokenize=False)
        return tok.encode(text + '<tool_call>\n{"name": "choose_square", "arguments": {"square": ',
                          add_special_tokens=False)

    def encode(items):
        return [dict(ids=prompt_ids(b["board"]), board=b["board"],
                     scores=[game.score_move(b["board"], s) if s in b["legal_moves"] else -1.0 for s in range(1, 10)])
                for b in items]

    out["train"], out["held"] = encode(train), encode(held)
    out["digit_ids"] = [tok.convert_tokens_to_ids(str(d)) for d in range(1, 10)]
    out["sft"] = [(s.input_ids, s.loss_mask) for s in
                  (render_chat(tok, c["messages"], c["tools"]) for c in make_sft_dataset(train, 2048, 2026))]
    torch.save(out, path)
    print(f"wrote {path}: sizes {list(SIZES)}")


class Qwen2(torch.nn.Module):
    def __init__(self, c, sd):
        super().__init__()
        self.c = c
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.float().clone()) for k, v in sd.items() if k != "lm_head.weight"})
        hd = c["hidden"] // c["heads"]
        inv = 1.0 / (c["theta"] ** (torch.arange(0, hd, 2).float() / hd))
        t = torch.arange(4096).float()
        f = torch.outer(t, inv); emb = torch.cat([f, f], -1)
        self.register_buffer("cos", emb.cos()); self.register_buffer("sin", emb.sin())
    def w(self, k): return self.p[k.replace(".", "__")]
    def norm(self, x, k): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["eps"]) * self.w(k)
    def forward(self, ids):
        c = self.c; B, T = ids.shape; H, KV = c["heads"], c["kv"]; hd = c["hidden"] // H
        E = self.w("model.embed_tokens.weight"); x = E[ids]
        cos, sin = self.cos[:T], self.sin[:T]
        def rope(q):
            q1, q2 = q[..., : hd // 2], q[..., hd // 2 :]
            return q * cos + torch.cat([-q2, q1], -1) * sin
        for i in range(c["layers"]):
            pre = f"model.layers.{i}."
            h = self.norm(x, pre + "input_layernorm.weight")
            q = F.linear(h, self.w(pre + "self_attn.q_proj.weight"), self.w(pre + "self_attn.q_proj.bias")).view(B, T, H, hd).transpose(1, 2)
            k = F.linear(h, self.w(pre + "self_attn.k_proj.weight"), self.w(pre + "self_attn.k_proj.bias")).view(B, T, KV, hd).transpose(1, 2)
            v = F.linear(h, self.w(pre + "self_attn.v_proj.weight"), self.w(pre + "self_attn.v_proj.bias")).view(B, T, KV, hd).transpose(1, 2)
            q, k = rope(q), rope(k)
            k = k.repeat_interleave(H // KV, 1); v = v.repeat_interleave(H // KV, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + F.linear(a, self.w(pre + "self_attn.o_proj.weight"))
            h = self.norm(x, pre + "post_attention_layernorm.weight")
            x = x + F.linear(F.silu(F.linear(h, self.w(pre + "mlp.gate_proj.weight"))) * F.linear(h, self.w(pre + "mlp.up_proj.weight")), self.w(pre + "mlp.down_proj.weight"))
        x = self.norm(x, "model.norm.weight")
        return x @ E.T

def pad(seqs, dev):
    T = max(map(len, seqs)); x = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs): x[i, : len(s)] = torch.tensor(s)
    return x.to(dev), torch.tensor([len(s) - 1 for s in seqs], device=dev)

def sched(warm, total, kind):
    def f(s):
        if s < warm: return (s + 1) / warm
        if kind == "cosine": return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warm) / max(1, total - warm))))
        return 1.0
    return f

def run(a, D, dev):
    random.seed(a.seed); torch.manual_seed(a.seed)
    weights = D["weights"][a.size]
    if a.init:  # a job's checkpoint (e.g. its SFT stage) instead of the export's initial weights; --sft-steps 0
        from safetensors.torch import load_file
        weights = load_file(f"{a.init}/model.safetensors")
    m = Qwen2(D["configs"][a.size], weights).to(dev)
    digit = torch.tensor(D["digit_ids"], device=dev)
    log = []
    # SFT
    opt = torch.optim.AdamW(m.parameters(), lr=a.sft_lr, weight_decay=0.0)
    sc = torch.optim.lr_scheduler.LambdaLR(opt, sched(10, a.sft_steps, "cosine"))
    rng = random.Random(a.seed)
    order = list(range(len(D["sft"])))
    for step in range(a.sft_steps):
        batch = [D["sft"][i] for i in rng.sample(order, a.sft_bs)]
        x, _ = pad([b[0] for b in batch], dev)
        mk = torch.zeros(x.shape, device=dev)
        for i, b in enumerate(batch):  # --sft-all: every token of the chat, prompt included (not only the answer)
            mk[i, : len(b[1])] = 1.0 if a.sft_all else torch.tensor(b[1], dtype=torch.float, device=dev)
        lg = m(x)[:, :-1]
        nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1)
        loss = (nll * mk[:, 1:]).sum() / mk[:, 1:].sum()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); sc.step()
    held = D["held"]; hx, hl = pad([h["ids"] for h in held], dev); hs = torch.tensor([h["scores"] for h in held], device=dev)
    @torch.no_grad()
    def ev():
        lp = torch.log_softmax(m(hx)[torch.arange(len(held), device=dev), hl], -1)
        g = lp.argmax(-1)
        dm = lp[:, digit].exp()
        isd = (g[:, None] == digit[None]).any(-1)
        gi = (g[:, None] == digit[None]).float().argmax(-1)
        sc_ = torch.where(isd, hs[torch.arange(len(held), device=dev), gi], torch.full_like(hs[:, 0], -1.0))
        pn = dm / dm.sum(-1, keepdim=True)
        legal_mass = float((pn * (hs > -1).float()).sum(-1).mean())
        H = float(-(pn * pn.clamp(min=1e-12).log()).sum(-1).mean())
        return dict(greedy_legal=float((sc_ > -1).float().mean()), greedy_opt=float((sc_ >= 0.8).float().mean()), legal_mass=legal_mass, H=H, digit_mass=float(dm.sum(-1).mean()))
    log.append(dict(step=0, **ev()))
    ref = None
    if a.kl:  # --kl: a frozen copy of the post-SFT model as the reference (the job's `algo.kl_coef`)
        ref = copy.deepcopy(m).requires_grad_(False)
    # RL
    train = D["train"]
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, a.beta2))
    sc = torch.optim.lr_scheduler.LambdaLR(opt, sched(a.warmup, a.steps, a.schedule))
    rews = []
    kl_end = a.kl if a.kl_end is None else a.kl_end
    for step in range(a.steps):
        if ref is not None and step and step == a.kl_reset:  # the reference moves to this policy
            ref = copy.deepcopy(m).requires_grad_(False)
        kl = a.kl + (kl_end - a.kl) * step / max(1, a.steps - 1)  # --kl-end: linear from --kl
        bs = rng.sample(train, a.boards)
        x, last = pad([b["ids"] for b in bs], dev)
        lp = torch.log_softmax(m(x)[torch.arange(len(bs), device=dev), last].float(), -1)  # (B, V)
        with torch.no_grad():
            pr = torch.softmax(lp / a.temp, -1)
            if a.top_p < 1.0:
                srt, idx = pr.sort(-1, descending=True); keep = (srt.cumsum(-1) - srt) < a.top_p
                pr = torch.zeros_like(pr).scatter(-1, idx, srt * keep)
            tok = torch.multinomial(pr, a.samples, replacement=True)  # (B, G)
            scores = torch.tensor([b["scores"] for b in bs], device=dev)
            isd = (tok[..., None] == digit).any(-1)
            idx = (tok[..., None] == digit).float().argmax(-1)
            r = torch.where(isd, scores.gather(1, idx), torch.full_like(idx, -1.0, dtype=torch.float))
            if a.adv == "group":
                std = r.std(1, keepdim=True) if a.scale else 1.0
                adv = (r - r.mean(1, keepdim=True)) / (std + 1e-6)
                adv[r.max(1).values == r.min(1).values] = 0.0
            else:
                adv = (r - r.mean()) / (r.std() + 1e-6)
        lp_tok = lp.gather(1, tok)  # (B, G) the sampled tokens' logprobs, with grad
        loss = -(adv * lp_tok).mean()
        if a.ent:
            p = lp.exp(); loss = loss - a.ent * (-(p * lp).sum(-1)).mean()
        if ref is not None:  # k3 on the sampled tokens, as rlsys/algos/regularizers.py
            with torch.no_grad():
                lr_ = torch.log_softmax(ref(x)[torch.arange(len(bs), device=dev), last].float(), -1).gather(1, tok)
            d = (lr_ - lp_tok).clamp(-20, 20)
            loss = loss + kl * (d.exp() - d - 1).mean()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); sc.step()
        rews.append(float(r.mean()))
        if (step + 1) % a.every == 0:
            log.append(dict(step=step + 1, rew=sum(rews[-a.every:]) / a.every, **ev()))
    return log

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--export", metavar="OUT.pt", help="write the data file (needs rlsys) and exit")
    ap.add_argument("--cells", action="store_true", help="with --export: the one-token-per-board-cell tokenizer")
    ap.add_argument("--size", default="h16"); ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=100); ap.add_argument("--sft-lr", type=float, default=3e-3); ap.add_argument("--sft-bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3); ap.add_argument("--steps", type=int, default=400); ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--schedule", default="constant"); ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--boards", type=int, default=4); ap.add_argument("--samples", type=int, default=4); ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--adv", default="group"); ap.add_argument("--scale", type=int, default=1); ap.add_argument("--ent", type=float, default=0.0)
    ap.add_argument("--kl", type=float, default=0.0, help="k3 KL penalty to the frozen post-SFT model (algo.kl_coef)")
    ap.add_argument("--kl-end", dest="kl_end", type=float, default=None, help="the penalty's value at the last step: "
                    "linear from --kl (a schedule the job does not have; for the probe)")
    ap.add_argument("--kl-reset", dest="kl_reset", type=int, default=0, help="at this GSPO step the reference becomes "
                    "a copy of the policy (what a second recipe stage with its own penalty does)")
    ap.add_argument("--every", type=int, default=50); ap.add_argument("--data", default="data.pt"); ap.add_argument("--dev", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sft-all", dest="sft_all", type=int, default=0, help="1: the SFT loss on the whole chat, prompt included")
    ap.add_argument("--init", help="start from this checkpoint folder's model.safetensors (a job's SFT stage)")
    ap.add_argument("--tag", default=""); ap.add_argument("--top-p", dest="top_p", type=float, default=1.0)
    ap.add_argument("--sweep", help="JSON file: list of arg dicts; runs each, prints one JSON line per run")
    a = ap.parse_args()
    if a.export:
        export(a.export, a.cells)
        sys.exit(0)
    D = torch.load(a.data, weights_only=False)
    runs = json.load(open(a.sweep)) if a.sweep else [{}]
    for over in runs:
        b = argparse.Namespace(**{**vars(a), **over})
        t0 = time.time()
        log = run(b, D, a.dev)
        print(json.dumps(dict(args=over, time=round(time.time() - t0, 1), log=log)), flush=True)
