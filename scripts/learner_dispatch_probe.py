"""The host's share of a learner micro-batch: a Qwen2.5-0.5B-shaped stack (24 layers, LoRA r=16 on its 7
projections, peft) at tiny widths, so that nearly all of a forward+backward's time is dispatch (Python, peft,
ATen), not arithmetic. Prints the time per micro-batch of 4 x 16 tokens and the ATen calls in it.

    python scripts/learner_dispatch_probe.py [--checkpointing]
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (the forward twice)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    if args.checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.base_model.model.enable_input_require_grads()
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (4, 16))

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
        torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()

    for _ in range(3):
        step()
    t = time.perf_counter()
    for _ in range(args.repeats):
        step()
    per_step = (time.perf_counter() - t) / args.repeats
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    print(f"checkpointing={args.checkpointing}: {per_step * 1e3:.1f} ms a micro-batch, {calls} ATen calls "
          f"(nested ones included)")


if __name__ == "__main__":
    main()
