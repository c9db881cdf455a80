"""The host's share of a learner micro-batch (issue 24, item 3): Qwen2.5-0.5B's 24 layers at tiny widths, so that
nearly all of the time is dispatch (Python, peft, ATen), not arithmetic, on one CPU thread.

- `bare`: the model with LoRA r=16 on its 7 projections (peft), one forward+backward of 4 rows x 16 tokens, and the
  ATen calls in it;
- then rlsys's learner (actors/learner.py with configs/gsm-qwen0.5b.toml's learner as of 2026-12-04 morning: LoRA,
  prefix sharing, micro-batches of 4; `recipe` pins that sharing, which the config has since turned off)
  on a gsm-shaped step of 8 problems x 8 answers with short rows (12-token prompt, two turns around a tool result),
  one line per variant: seconds a step, micro-batches, milliseconds per micro-batch.

    python scripts/learner_dispatch_probe.py [--variants recipe,no-sharing,...] [--out FILE.jsonl]

On a GPU whose learner is bound by its host, these per-micro-batch costs are what a step pays beside the
arithmetic; the variants say which settings cut them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS = {
    "recipe": ["learner.prefix_sharing=true"],  # as measured on 2026-12-04 (data/cpu-2026-12-04d)
    "no-sharing": ["learner.prefix_sharing=false"],
    "mbs16": ["learner.prefix_sharing=true", "learner.mini_bs=16"],
    # ~16 of these short rows a micro-batch
    "tok-budget": ["learner.prefix_sharing=true", "learner.micro_batch_tokens=512"],
    "no-sharing-tok-budget": ["learner.prefix_sharing=false", "learner.micro_batch_tokens=512"],
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NARROW = {"hidden_size": 64, "num_hidden_layers": 24, "num_attention_heads": 2, "num_key_value_heads": 1,
          "intermediate_size": 128, "tie_word_embeddings": True, "max_position_embeddings": 512}


def narrow_model(cache: Path) -> Path:
    """An HF folder: the narrow 24-layer Qwen2 with the tiny model's tokenizer (built once)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from jobs.bench_models import model_folder

    out = cache / "qwen24-narrow"
    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(model_folder("tiny", cache))
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(**NARROW, vocab_size=len(tok), bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                         use_sliding_window=False)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bare(folder: Path, repeats: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=16, target_modules=TARGETS))
    model.train()
    ids = torch.randint(3, model.config.vocab_size, (4, 16))

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
        torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()

    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    per_step = (time.perf_counter() - t) / repeats
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return {"variant": "bare", "per_micro_ms": round(per_step * 1e3, 1), "aten_calls": calls}


def learner_variant(name: str, folder: Path, repeats: int) -> dict:
    from actors.learner import Learner
    from jobs.placement import learner_settings
    from rlsys.config import load_config

    cfg = load_config("configs/gsm-qwen0.5b.toml", overrides=[
        "logging.progress=false", "learner.adam_8bit=false", "model.dtype=float32", *VARIANTS[name]])
    learner = Learner(learner_settings(cfg, str(folder)), str(folder))
    from scripts.profile_learner import batch as gsm_step

    batch = gsm_step(int(learner.model.config.vocab_size), seed=0, prompt_len=12, first=(4, 10), tool=3, second=(3, 8))
    for _ in range(2):
        learner.train(batch)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        stats = learner.train(batch)
        times.append(time.perf_counter() - t)
    best, micro = min(times), stats["train/micro_batches"]
    return {"variant": name, "overrides": VARIANTS[name], "step_s": round(best, 3), "micro_batches": micro,
            "per_micro_ms": round(best / micro * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default="/tmp/rlsys-dispatch-probe")
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    folder = narrow_model(Path(args.cache))
    log = open(args.out, "a") if args.out else None
    runs = [lambda: bare(folder, 10 * args.repeats)]
    runs += [lambda v=v: learner_variant(v, folder, args.repeats) for v in args.variants.split(",")]
    for run in runs:
        rec = run()
        print(json.dumps(rec), flush=True)
        if log:
            log.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
