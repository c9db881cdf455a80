"""Learner time per GSPO step with and without `learner.prefix_sharing`, without rollouts (docs/results-cpu.md).

Builds one step's batch as the recipe's GSPO stage makes it (configs/tictactoe-tiny-gspo.toml: 8 training boards x
8 samples, the real chat-templated prompts, answers of 18-22 tokens: the canonical `choose_square` call with a
random square), then times `Learner.train` on such batches, sharing on and off in turn: one learner per mode
from the same checkpoint, trained on the same batches in the same order, so both stay at the same weights.
Prints the per-call seconds of each mode (`time/learner_compute` of the job) and the median ratio.

    nice -n 19 .venv/bin/python scripts/prefix_sharing_bench.py CKPT [REPS]
"""
import random
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

from actors.learner import Learner
from jobs.placement import learner_settings
from jobs.items import load_items
from rlsys.config import load_config
from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL, messages_for
from rlsys.types import Segment, Trajectory

CALL = '<tool_call>\n{"name": "choose_square", "arguments": {"square": %d}}\n</tool_call>'


def step_batch(cfg, tok, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    items = rng.sample(load_items(cfg.data, cfg.algo.name, cfg.env.environment()), cfg.rollout.batch_size)
    out = []
    for group, item in enumerate(items):
        text = tok.apply_chat_template(messages_for(item["board"]), tools=[CHOOSE_SQUARE_TOOL],
                                       add_generation_prompt=True, tokenize=False)
        prompt = tok(text, add_special_tokens=False).input_ids
        for sample in range(cfg.rollout.n_samples):
            answer = tok(CALL % rng.randint(1, 9), add_special_tokens=False).input_ids
            answer = answer + [tok.eos_token_id] * rng.randint(0, 3)  # 18-22 sampled tokens, like the job's
            seg = Segment(prompt + answer, [0] * len(prompt) + [1] * len(answer),
                          [0.0] * len(prompt) + [-0.5] * len(answer))
            out.append(Trajectory(item_id=str(item.get("id", group)), group=group, sample=sample,
                                  segments=[seg], reward=rng.choice([1.0, 0.0, -1.0]), num_turns=1))
    return out


def main() -> None:
    ckpt, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    tok = AutoTokenizer.from_pretrained(ckpt)
    cfgs = {on: load_config(path="configs/tictactoe-tiny-gspo.toml",
                            overrides=[f"model.ckpt={ckpt!r}", f"learner.prefix_sharing={str(on).lower()}",
                                       "run_dir='/tmp/prefix-bench'",
                                       # the reference in the learner, as when this was measured: no actor here
                                       "learner.reference_actor=false"]) for on in (True, False)}
    learners = {on: Learner(learner_settings(cfg, ckpt), ckpt, num_threads=torch.get_num_threads())
                for on, cfg in cfgs.items()}
    batches = [step_batch(cfgs[True], tok, seed) for seed in range(reps)]
    print(f"prompt {len(batches[0][0].segments[0].input_ids) - batches[0][0].response_len} tokens, "
          f"{len(batches[0])} sequences a step, threads {torch.get_num_threads()}", flush=True)
    times = {True: [], False: []}
    for i, batch in enumerate(batches):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            stats = learners[on].train(batch)
            times[on].append(time.perf_counter() - t0)
            print(f"rep {i} sharing {on!s:5}  {times[on][-1]:.2f} s  loss {stats['train/loss']:+.6f}  "
                  f"saved {stats.get('train/prefix_saved_frac', 0.0):.2f}", flush=True)
    on, off = statistics.median(times[True][1:]), statistics.median(times[False][1:])  # the first call warms up
    print(f"median learner s/step: sharing {on:.2f}, plain {off:.2f}, plain/sharing {off / on:.1f}x")


if __name__ == "__main__":
    main()
