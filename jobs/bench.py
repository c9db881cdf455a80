"""Benchmarks of the job: `python -m jobs.bench {step,proxy,learner,sync,cpu-decode} ...` (docs/performance.md: the commands).

`step`: N steps of a config through the real job (jobs/train.py's `run_training`, Ray actors and all), then the
step-time breakdown from metrics.jsonl over the steps after the warm-up: generation (seconds the engine had a
request in flight), agent/reward (the rest of the rollout phase), sleep, train (learner compute, trajectory fetch,
call overhead), push, wake, canary, and the driver/object-store remainder; tokens/s; the overhead fraction
1 - (generation + learner compute) / step; GPU memory per phase (null on CPU). `--random-reward` scores every
trajectory with a deterministic pseudo-random number, so a random-weight model still trains every sequence.

`proxy`: the environment's first requests (`Environment.first_request`: chat template with the tools, the job's
sampling, `n_samples` each; meant for single-request agents such as the default environment's) (a) straight
into the rollout actor's engine (`RolloutWorker.bench_generate`) and (b) through the whole agent path (env worker
-> openai client -> proxy -> engine -> tool-call parser), on the same engine in one run; tokens/s of both and
the ratio b/a. The engine follows `rollout.engine` (auto: vLLM on a GPU, transformers on CPU).

`proxy-cpu`: the proxy's own CPU cost per request, with nothing else in its process: the real app and uvicorn with
an engine that answers at once (`--new-tokens` random ids), called by the default environment's agent with the
openai client from this process (`--requests` at once, `--boards` distinct boards, i.e. requests/boards samples of
each); the server process's CPU seconds per request (`time.process_time`). `--http h11` and `--render-cache 0`
measure the proxy without httptools and without its render cache. CPU only, no Ray.

`cpu-decode`: the CPU engine's generate on the main job's rollout (configs/tictactoe-tiny-gspo.toml: 8 items x 8
samples, its environment's first requests, its temperature/top-p/max_new_tokens, the main recipe's model shape
`rlsys:tiny-h16` with random weights), with the
transformers loop (old) and rlsys/engines/cpu_decode.py (new) alternating; tokens/s of both, the ratio, and how many
answers are equal.

`learner`: the learner alone (actors/learner.py's `Learner.train`, no Ray, no engine) on synthetic GSPO batches of
a config's shape: `--groups` prompts of `--prompt-tokens` random ids, `--samples` answers each with lengths drawn
log-uniformly in [`--answer-min`, `--answer-max`] (gsm's spread), rewards that give every answer an advantage.
Each `--variant NAME=key=value,...` (default: the learner's two row orders, `learner.length_order` true / false)
builds its own learner from the same weights and trains `--warmup` + `--steps` steps on the same batches; per
variant the median `time/learner_compute`, forward+backward tokens/s (the rows' real tokens over that time),
`train/padded_frac` and peak memory. The learner phase of a job, measured without the rollout sharing the device.

`sync`: the weight push learner -> vLLM on one GPU, without Ray in between (the learner side runs in this
process, vLLM's engine core in its own, so the CUDA IPC crosses processes as in a job). Per push:
- pack: the learner's parameters copied into the reusable bucket buffers (`FusedPack`, as the learner does);
- handle: `CudaIpcTransport.export` (a `reduce_tensor` per buffer on the first push, cached afterwards);
- load: `VLLMEngine.load_payload`: one `collective_rpc`, the worker opens (first push) or reuses the mapping
  and copies into the model; `worker` is the part spent inside vLLM's worker;
- canary: the fixed sequence scored by vLLM and by the learner, compared;
- total: pack + handle + load (the refit itself); GiB/s and ms/GiB over the bf16 bytes pushed.
Then sleep/wake cycles as the driver runs them (sleep(level), wake weights, push, wake KV cache, reset
the prefix cache), per level, timing sleep and the two wakes. Prints a table; `--out` writes the JSON.

The random models have Qwen2.5-0.5B's or Qwen2.5-1.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocab 151936, tied embeddings; 1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960) and
rlsys's tiny tokenizer: the weights are random, the sizes are real.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from jobs.bench_learner import bench_learner, print_learner
from jobs.bench_models import RANDOM_MODELS, model_folder
from jobs.bench_rollout import bench_cpu_decode, bench_proxy, bench_proxy_cpu, print_cpu_decode, print_proxy_table
from jobs.bench_step import bench_step, compare_table, print_step_table
from jobs.bench_sync import bench_sync, print_sync_table
from jobs.host import host, host_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    models = f"tiny | {' | '.join(RANDOM_MODELS)}"
    step = sub.add_parser("step", help="N steps of a config: step-time breakdown, tokens/s, memory per phase")
    step.add_argument("--config", help="TOML config (overrides win)")
    step.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    step.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings")
    step.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    step.add_argument("--random-reward", action="store_true", help="score with jobs.bench_step:random_reward")
    step.add_argument("--run-dir", help="the job's run directory (default: a new temporary one)")
    proxy = sub.add_parser("proxy", help="the environment's prompts: direct engine generate vs the full agent path")
    proxy.add_argument("--config", help="TOML config (overrides win)")
    proxy.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    proxy.add_argument("--rounds", type=int, default=3, help="timed (direct, agent) pairs after a warm-up")
    proxy.add_argument("--env-workers", type=lambda v: [x if x == "auto" else int(x) for x in v.split(",")],
                       help="env worker counts to measure the agent path with, one after the other, comma-separated "
                            "(e.g. auto,2; default: the config's env.num_workers)")
    for p in (step, proxy):
        p.add_argument("--cache", default="/tmp/rlsys-bench", help="where named models are built")
        p.add_argument("--out", help="write the results as JSON here")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    lrn = sub.add_parser("learner", help="the learner alone on synthetic batches: tokens/s, padding, memory")
    lrn.add_argument("--config", default="configs/gsm-qwen0.5b.toml", help="the learner's settings (overrides win)")
    lrn.add_argument("--model", help=f"{models}, or any model.ckpt value (default: the config's)")
    lrn.add_argument("--groups", type=int, default=8, help="prompts a step")
    lrn.add_argument("--samples", type=int, default=8, help="answers a prompt")
    lrn.add_argument("--prompt-tokens", type=int, default=450)
    lrn.add_argument("--common-tokens", type=int, default=0, help="of them, the same in every prompt")
    lrn.add_argument("--answer-min", type=int, default=100)
    lrn.add_argument("--answer-max", type=int, default=1500)
    lrn.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    lrn.add_argument("--warmup", type=int, default=1)
    lrn.add_argument("--variant", action="append", metavar="NAME=KEY=VALUE,...",
                     help="a learner to measure (repeatable; default: learner.length_order true and false)")
    lrn.add_argument("--cache", default="/tmp/rlsys-bench", help="where named models are built")
    lrn.add_argument("--out", help="write the results as JSON here")
    lrn.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides for every variant")
    cost = sub.add_parser("proxy-cpu", help="the proxy's CPU seconds per request, with an instant engine")
    cost.add_argument("--requests", type=int, default=128, help="requests at once per round")
    cost.add_argument("--boards", type=int, default=16, help="distinct boards among them")
    cost.add_argument("--rounds", type=int, default=5)
    cost.add_argument("--new-tokens", type=int, default=128, help="ids in each instant answer")
    cost.add_argument("--http", default="auto", help="uvicorn's HTTP implementation: auto (httptools) or h11")
    cost.add_argument("--render-cache", type=int, default=None, help="proxy render cache size (0: off)")
    cost.add_argument("--out", help="write the results as JSON here")
    sync = sub.add_parser("sync", help="weight push learner -> vLLM (CUDA IPC), sleep/wake")
    sync.add_argument("--model", nargs="+", default=["tiny"], help=f"{models} (several: one after the other)")
    sync.add_argument("--pushes", type=int, default=20, help="timed pushes after the first")
    sync.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level")
    sync.add_argument("--sleep-levels", type=int, nargs="+", default=[1, 2])
    sync.add_argument("--bucket-mb", type=int, default=512)
    sync.add_argument("--budget-gib", type=float, default=8.0, help="vLLM's GPU memory budget")
    sync.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    sync.add_argument("--cache", default="/tmp/rlsys-bench", help="where model folders are built")
    sync.add_argument("--out", help="write the results as JSON here")
    cmp = sub.add_parser("compare", help="`step` results side by side (a scale-out table, markdown)")
    cmp.add_argument("runs", nargs="+", metavar="NAME=FILE.json", help="bench step JSONs; the first is the baseline")
    dec = sub.add_parser("cpu-decode", help="the CPU engine's decode loops, old vs new, on the main job's rollout")
    dec.add_argument("--config", default="configs/tictactoe-tiny-gspo.toml", help="rollout shape and sampling")
    dec.add_argument("--model", default="rlsys:tiny-h16",
                     help="any model.ckpt value (default: the main recipe's shape, configs/tictactoe-tiny-sft.toml)")
    dec.add_argument("--rounds", type=int, default=5, help="timed (old, new) pairs after a warm-up")
    dec.add_argument("--boards", type=int, help="prompts (default: the config's rollout.batch_size)")
    dec.add_argument("--samples", type=int, help="answers per prompt (default: rollout.n_samples)")
    dec.add_argument("--max-new-tokens", type=int, help="default: rollout.max_new_tokens")
    dec.add_argument("--temperature", type=float, help="default: rollout.temperature")
    dec.add_argument("--top-p", type=float, help="default: rollout.top_p")
    dec.add_argument("--threads", type=int, help="torch threads (default: the config's rollout.engine_threads)")
    dec.add_argument("--out", help="write the results as JSON here")
    build = sub.add_parser("model", help="build a named bench model; prints its folder")
    build.add_argument("--model", required=True, help=models)
    build.add_argument("--cache", default="/tmp/rlsys-bench")
    args = parser.parse_args(argv)
    if args.command == "model":
        print(model_folder(args.model, Path(args.cache)))
        return 0
    if args.command == "compare":
        runs = []
        for spec in args.runs:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                parser.error(f"compare: {spec!r} is not NAME=FILE.json")
            try:
                runs.append((name, json.loads(Path(path).read_text())))
            except (OSError, ValueError) as err:
                parser.error(f"compare: {path}: {err}")
        print(compare_table(runs))
        return 0
    local = {"cpu-decode": (bench_cpu_decode, print_cpu_decode), "learner": (bench_learner, print_learner)}
    if args.command in local:  # in this process, no Ray: measure, write the JSON, print the table
        measure, show = local[args.command]
        result = with_host(measure(args))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        show(result)
        return 0
    if args.command == "proxy-cpu":
        result = with_host(bench_proxy_cpu(args))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"proxy CPU per request ({result['http']}, render cache {result['render_cache']}): "
              f"{result['cpu_ms_per_request']:.2f} ms median over {args.rounds} rounds of {args.requests} requests "
              f"({args.boards} boards); rounds {[round(r['wall_s'], 3) for r in result['rounds']]} s wall")
        return 0
    if args.command in ("step", "proxy"):
        from rlsys.errors import UserInputError

        try:
            result = with_host(bench_step(args) if args.command == "step" else bench_proxy(args))
        except UserInputError as err:
            print(f"rlsys: {err}", file=sys.stderr)
            return 2
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        (print_step_table if args.command == "step" else print_proxy_table)(result)
        return 0
    # this process touches CUDA before vLLM starts its engine core: fork would break the child
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    results: dict[str, Any] = {}
    failed = False
    where = with_host({})["host"]  # every model's result names the host: pushes differ between hosts
    for name in args.model:
        try:
            results[name] = {**asyncio.run(bench_sync(args, name)), "host": where}
            print_sync_table(results[name])
        except Exception as err:  # one model failing must not hide the others' numbers; reported, exit 1
            failed = True
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            traceback.print_exc()
        if args.out:  # after each model, so a timeout still leaves what was measured
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


def with_host(result: dict[str, Any]) -> dict[str, Any]:
    """The result with the host it was measured on (jobs/host.py), printed too: numbers of two hosts differ."""
    result["host"] = host()
    print(host_line(result["host"]))
    return result


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running main
    sys.exit(main())
