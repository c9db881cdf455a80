"""`python -m jobs.bench proxy`, `proxy-cpu` and `cpu-decode`: the rollout path's benchmarks (jobs/bench.py says what
each measures)."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from jobs.bench_models import model_ckpt


# ------------------------------------------------------------------ proxy: direct engine vs the agent path
def bench_proxy(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch
    from transformers import AutoTokenizer

    from actors.rollout import RolloutWorker
    from jobs.episodes import agent_calls, run_episodes
    from jobs.items import first_prompts, load_items
    from jobs.placement import engine_settings, gpu_actor_env, make_env_workers
    from jobs.session import init_ray
    from rlsys.config import load_config
    from rlsys.engines import resolve_engine_kind
    from rlsys.models.resolve import resolve_model

    flags = {"--ckpt": model_ckpt(args.model, Path(args.cache))} if args.model else {}
    cfg = load_config(args.config, flags=flags, overrides=["logging.progress=false", *args.overrides])
    env = cfg.env.environment()
    if env.first_request is None:
        raise SystemExit(f"bench proxy renders the environment's first requests; {env.name} does not give them "
                         "(Environment.first_request; another agent than the environment's has none)")
    model_path = resolve_model(cfg.model.ckpt)
    owns_ray = init_ray(cfg.cluster, "rlsys-bench-proxy")
    actors: list[Any] = []
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        where = {"num_gpus": 1, "runtime_env": {"env_vars": gpu_actor_env()}} if gpus else {}
        threads = None if gpus else max(1, os.cpu_count() or 1)
        rollout = ray.remote(RolloutWorker).options(name="rollout-bench", num_cpus=0, max_concurrency=1024,
                                                    **where).remote(engine_settings(cfg, model_path), model_path,
                                                                   num_threads=threads)
        actors.append(rollout)
        t0 = time.perf_counter()
        info = ray.get(rollout.start.remote())
        engine_start_s = time.perf_counter() - t0
        proxy = {**info, "actor": rollout}
        r = cfg.rollout
        items = load_items(cfg.data, cfg.algo.name, env)[: r.batch_size]
        prompts = first_prompts(env, items, AutoTokenizer.from_pretrained(model_path))

        def direct() -> dict[str, float]:
            return ray.get(rollout.bench_generate.remote(prompts, r.n_samples))

        def agent_path(workers: list[Any], tag: str) -> tuple[dict[str, float], list[Any]]:
            t = time.perf_counter()
            refs, summaries = run_episodes(workers, [proxy], items, r.n_samples,
                                           agent_calls(lambda g, s: f"bench-{tag}-item{g}-sample{s}"))
            wall = time.perf_counter() - t
            failed = [s.fail_reason for s in summaries if s.failed]
            return {"tokens": float(sum(s.response_len for s in summaries)), "wall_s": wall,
                    "requests": float(len(summaries)), "failed": float(len(failed)), "fail_reasons": failed[:4]}, refs

        direct()  # warm-up: engine kernels
        by_workers, first_refs = {}, None
        for v, count in enumerate(args.env_workers or [cfg.env.num_workers]):
            env = cfg.env.model_copy(update={"num_workers": count})
            workers = make_env_workers(env, nodes=[info["node_id"]], name=f"env-bench{v}")
            actors += workers
            agent_path(workers, f"warmup{v}")  # env workers' imports and HTTP connections
            rounds = []
            for k in range(args.rounds):  # alternating which path goes first, so drift favours neither
                if k % 2:
                    b, refs = agent_path(workers, f"{v}-{k}")
                    a = direct()
                else:
                    a = direct()
                    b, refs = agent_path(workers, f"{v}-{k}")
                first_refs = first_refs or refs
                rounds.append({"direct": a, "agent": b, "direct_tps": a["tokens"] / a["wall_s"],
                               "agent_tps": b["tokens"] / b["wall_s"]})
                rounds[-1]["ratio"] = rounds[-1]["agent_tps"] / rounds[-1]["direct_tps"]
            by_workers[str(count)] = {
                "env_workers": len(workers), "rounds": rounds,
                "concurrency": min(len(prompts) * r.n_samples, r.engine_max_batch,
                                   len(workers) * cfg.env.max_concurrency),
                "direct_tps": statistics.median(x["direct_tps"] for x in rounds),
                "agent_tps": statistics.median(x["agent_tps"] for x in rounds),
                "ratio": statistics.median(x["ratio"] for x in rounds)}
            for w in workers:
                ray.kill(w, no_restart=True)
        traj = ray.get(first_refs[0])
        sent = traj.segments[0].input_ids[: len(prompts[0])] if traj.segments else []
        first = next(iter(by_workers.values()))
        return {
            "model": cfg.model.ckpt,
            "engine": resolve_engine_kind(cfg.rollout.engine, torch.cuda.is_available) if not gpus else "vllm (auto, GPU)",
            "engine_start_s": engine_start_s, "prompts": len(prompts), "n_samples": r.n_samples,
            "max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
            "prompt_tokens": statistics.fmean(len(p) for p in prompts), "prompts_match": sent == prompts[0],
            "by_env_workers": by_workers,
            **{k: first[k] for k in ("env_workers", "concurrency", "rounds", "direct_tps", "agent_tps", "ratio")},
        }
    finally:
        for actor in actors[:1]:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as err:  # going down anyway; say why it was not clean
                print(f"bench proxy: rollout shutdown: {type(err).__name__}: {err}", flush=True)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if owns_ray:
            ray.shutdown()


def print_proxy_table(r: dict[str, Any]) -> None:
    print(f"\nproxy overhead, {r['model']} ({r['engine']}): {r['prompts']} prompts x {r['n_samples']} samples, "
          f"{r['prompt_tokens']:.0f}-token prompts, max_new_tokens {r['max_new_tokens']}")
    print(f"{'workers':<9}{'round':<7}{'direct tok/s':>14}{'agent tok/s':>14}{'ratio':>8}{'direct tok':>12}"
          f"{'agent tok':>11}{'failed':>8}")
    for v in r["by_env_workers"].values():
        for k, x in enumerate(v["rounds"]):
            print(f"{v['env_workers']:<9}{k:<7}{x['direct_tps']:14.0f}{x['agent_tps']:14.0f}{x['ratio']:8.3f}"
                  f"{x['direct']['tokens']:12.0f}{x['agent']['tokens']:11.0f}{x['agent']['failed']:8.0f}")
        print(f"median with {v['env_workers']} env workers (concurrency {v['concurrency']}): direct "
              f"{v['direct_tps']:.0f} tok/s, agent path {v['agent_tps']:.0f} tok/s, ratio {v['ratio']:.3f} "
              "[goal >= 0.9]")
    print(f"prompts identical on both paths: {r['prompts_match']}")


def bench_cpu_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Tokens/s of ``TransformersEngine`` with its transformers loop (old) and rlsys/engines/cpu_decode.py (new) on
    the main job's rollout shape; rounds alternate which loop goes first, so drift from other load favours neither."""
    import torch
    from transformers import AutoTokenizer

    from jobs.items import first_prompts, load_items
    from rlsys.config import load_config
    from rlsys.engines import SamplingParams
    from rlsys.engines.transformers_engine import TransformersEngine
    from rlsys.models.resolve import resolve_model

    cfg = load_config(args.config)
    r = cfg.rollout
    boards = args.boards or r.batch_size
    samples = args.samples or r.n_samples
    new_tokens = args.max_new_tokens or r.max_new_tokens
    temperature = r.temperature if args.temperature is None else args.temperature
    top_p = r.top_p if args.top_p is None else args.top_p
    model_path = resolve_model(args.model)
    env = cfg.env.environment()
    items = load_items(cfg.data.model_copy(update={"num_items": boards, "seed": 0}), cfg.algo.name, env)[:boards]
    prompts = first_prompts(env, items, AutoTokenizer.from_pretrained(model_path))
    threads = args.threads or r.engine_threads or max(1, os.cpu_count() or 1)  # the job's engine: 1 (rlsys/config.py)
    # batch_wait_s=0: the gathered calls are all queued before the batcher runs, so each round is one batch
    engines = {name: TransformersEngine(model_path, max_batch_size=boards * samples, batch_wait_s=0.0, seed=0,
                                        num_threads=threads, fast_decode=fast)
               for name, fast in (("old", False), ("new", True))}

    async def one_round(engine: Any, seed: int) -> tuple[float, list[Any]]:
        calls = [engine.generate(p, SamplingParams(max_new_tokens=new_tokens, temperature=temperature, top_p=top_p,
                                                   seed=seed * 1000 + g * 100 + s))
                 for g, p in enumerate(prompts) for s in range(samples)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*calls)
        return time.perf_counter() - t0, outs

    async def rounds() -> list[dict[str, Any]]:
        for engine in engines.values():
            await one_round(engine, 10**6)  # warm-up: allocator, kernels, the fused weights
        out = []
        for k in range(args.rounds):
            order = list(engines) if k % 2 == 0 else list(engines)[::-1]
            timed = {name: await one_round(engines[name], k) for name in order}
            row: dict[str, Any] = {}
            for name, (wall, outs) in timed.items():
                row[f"{name}_tokens"] = sum(len(o.token_ids) for o in outs)
                row[f"{name}_s"] = wall
                row[f"{name}_tps"] = row[f"{name}_tokens"] / wall
            row["same_answers"] = sum(a.token_ids == b.token_ids for a, b in zip(timed["old"][1], timed["new"][1]))
            out.append(row)
        for engine in engines.values():
            await engine.shutdown()
        return out

    timed = asyncio.run(rounds())
    old_tps = statistics.median(x["old_tps"] for x in timed)
    new_tps = statistics.median(x["new_tps"] for x in timed)
    return {"model": args.model, "threads": threads, "torch_threads": torch.get_num_threads(), "boards": boards,
            "samples": samples, "answers": boards * samples, "max_new_tokens": new_tokens,
            "temperature": temperature, "top_p": top_p, "prompt_tokens": statistics.fmean(len(p) for p in prompts),
            "rounds": timed, "old_tps": old_tps, "new_tps": new_tps, "ratio": new_tps / old_tps,
            "same_answers": sum(x["same_answers"] for x in timed) / (len(timed) * boards * samples)}


def print_cpu_decode(r: dict[str, Any]) -> None:
    print(f"\ncpu decode, {r['model']}: {r['answers']} answers ({r['boards']} boards x {r['samples']}), "
          f"{r['prompt_tokens']:.0f}-token prompts, max_new_tokens {r['max_new_tokens']}, T {r['temperature']}, "
          f"top-p {r['top_p']}, {r['threads']} threads")
    print(f"{'round':<7}{'old tok/s':>11}{'new tok/s':>11}{'ratio':>8}{'old s':>8}{'new s':>8}{'same':>6}")
    for k, x in enumerate(r["rounds"]):
        print(f"{k:<7}{x['old_tps']:11.0f}{x['new_tps']:11.0f}{x['new_tps'] / x['old_tps']:8.2f}{x['old_s']:8.3f}"
              f"{x['new_s']:8.3f}{x['same_answers']:6d}")
    print(f"median: old {r['old_tps']:.0f} tok/s, new {r['new_tps']:.0f} tok/s, ratio {r['ratio']:.2f} [goal >= 5]; "
          f"identical answers {r['same_answers']:.1%}")


def _proxy_cpu_server(conn: Any, http: str, cache: int | None, new_tokens: int) -> None:
    """`proxy-cpu`'s server process: the proxy app over an instant engine; answers each round's CPU seconds."""
    import random

    from transformers import AutoTokenizer

    from rlsys.engines.base import Engine, GenerateOutput, SamplingParams
    from rlsys.models.resolve import resolve_model
    from rlsys.proxy.server import RENDER_CACHE_SIZE, ProxyServer, create_app
    from rlsys.proxy.sessions import SessionRecorder

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("rlsys:tiny"))
    rng, vocab = random.Random(0), len(tokenizer)

    class Instant(Engine):
        max_model_len = 1024

        async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
            ids = [rng.randrange(100, vocab - 16) for _ in range(new_tokens)]
            return GenerateOutput(ids, [-1.0] * len(ids), "length")

        async def score(self, prompt_ids, continuation_ids):
            raise NotImplementedError

        def load_weights(self, named_tensors):
            raise NotImplementedError

    app = create_app(Instant(), tokenizer, api_token="bench", model_name="m", recorder=SessionRecorder(),
                     sampling_defaults=SamplingParams(max_new_tokens=new_tokens), max_tokens_cap=new_tokens,
                     render_cache_size=RENDER_CACHE_SIZE if cache is None else cache)

    async def serve() -> None:
        server = ProxyServer(app, http=http)
        conn.send(await server.start())
        loop = asyncio.get_running_loop()
        while (msg := await loop.run_in_executor(None, conn.recv)) != "stop":  # "tick": CPU seconds so far
            conn.send(time.process_time())
        await server.stop()

    asyncio.run(serve())


def bench_proxy_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp

    import httpx
    import openai

    from rlsys.config import DataConfig
    from rlsys.envs.base import DEFAULT_ENV, load_environment

    ours, theirs = mp.Pipe()
    server = mp.get_context("spawn").Process(target=_proxy_cpu_server, daemon=True,
                                             args=(theirs, args.http, args.render_cache, args.new_tokens))
    server.start()
    url = ours.recv()
    env = load_environment(DEFAULT_ENV)
    agent = env.agent
    items = env.train_items(DataConfig(num_items=args.boards, seed=0))

    async def rounds() -> list[dict[str, float]]:
        limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
        client = openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=120,
                                    http_client=httpx.AsyncClient(limits=limits))
        out = []
        for r in range(args.rounds + 1):  # the first warms the connections up, not timed
            ours.send("tick")
            cpu0, t0 = ours.recv(), time.perf_counter()
            await asyncio.gather(*[agent(items[i % len(items)], client, "m") for i in range(args.requests)])
            wall = time.perf_counter() - t0
            ours.send("tick")
            if r:
                out.append({"wall_s": wall, "cpu_s": ours.recv() - cpu0})
            else:
                ours.recv()
        return out

    try:
        timed = asyncio.run(rounds())
    finally:
        ours.send("stop")
        server.join(30)
    per_request = statistics.median(r["cpu_s"] for r in timed) / args.requests
    return {"http": args.http, "render_cache": "default" if args.render_cache is None else args.render_cache,
            "requests": args.requests, "boards": args.boards, "new_tokens": args.new_tokens,
            "cpu_ms_per_request": per_request * 1e3, "rounds": timed}
