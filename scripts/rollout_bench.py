"""Engine time of one recipe GSPO rollout, without the proxy, agents or Ray (docs/results-cpu.md).

Sends the 64 generate calls of one step as the recipe's GSPO stage makes them (configs/tictactoe-tiny-gspo.toml:
8 training boards x 8 samples, the real chat-templated prompts, T=1.3, top-p 0.9, 24 new tokens, a seed per
sample) to a `TransformersEngine` at once, as the proxy does, and prints the seconds each step's batch took.

    nice -n 19 .venv/bin/python scripts/rollout_bench.py CKPT [REPS]
"""
import asyncio
import random
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

from jobs.items import load_items
from rlsys.config import load_config
from rlsys.engines import SamplingParams
from rlsys.engines.transformers_engine import TransformersEngine
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for


def step_prompts(cfg, tok, seed: int) -> list[list[int]]:
    items = load_items(cfg.data, cfg.algo.name, cfg.env.environment())
    items = random.Random(seed).sample(items, cfg.rollout.batch_size)
    out = []
    for item in items:
        text = tok.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                       add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


async def one_step(engine, cfg, prompts, seed: int):
    r = cfg.rollout
    calls = [engine.generate(p, SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                               top_p=r.top_p, seed=seed * 1000 + g * 100 + s))
             for g, p in enumerate(prompts) for s in range(r.n_samples)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*calls)
    return time.perf_counter() - t0, outs


async def main() -> None:
    ckpt = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    cfg = load_config(path="configs/tictactoe-tiny-gspo.toml", overrides=[f"model.ckpt={ckpt!r}"])
    tok = AutoTokenizer.from_pretrained(ckpt)
    engine = TransformersEngine(ckpt, max_batch_size=cfg.rollout.engine_max_batch, seed=0,
                                num_threads=cfg.rollout.engine_threads)
    print(f"threads {torch.get_num_threads()}, prompt {len(step_prompts(cfg, tok, 0)[0])} tokens", flush=True)
    await one_step(engine, cfg, step_prompts(cfg, tok, 99), 99)  # warm-up
    times, tokens = [], []
    for rep in range(reps):
        dt, outs = await one_step(engine, cfg, step_prompts(cfg, tok, rep), rep)
        times.append(dt)
        tokens.append(sum(len(o.token_ids) for o in outs))
        print(f"step {rep}: {dt:.3f} s, {tokens[-1]} tokens", flush=True)
    print(f"median {statistics.median(times):.3f} s over {reps} steps", flush=True)
    await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
