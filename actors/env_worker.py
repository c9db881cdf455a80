"""Env worker: runs the environment's agent against a rollout proxy and scores it with its reward.

An async actor (many episodes at once, `max_concurrency`), CPU only, restarted by Ray if its process dies.
The driver hands it episodes in batches (`run_episodes`: one Ray call for a worker's share of a wave). Each
episode gets a session id; the proxy records the episode's turns under it, and the worker pops them (one call
for the batch) when the batch's agents have returned, so the learner trains on the exact tokens sampled. An
agent that raises or runs past its timeout, or a reward that raises, hangs, or returns something that is not a
finite number, marks the trajectory failed with the reason: counted in metrics, excluded from advantages, never
scored 0.
Popping ends the session's life in the proxy: a request the agent left in flight (a timeout) is dropped
when it completes and counted in the proxy's `late_turns`, instead of leaving an orphan session. Every run
of an episode tags its requests with a fresh attempt token (`X-Rlsys-Attempt`), so a retry after a worker
death starts a new life of the session and pops only its own turns (rlsys/proxy/sessions.py, "Attempts"),
with no Ray call to the rollout actor before the agent's first request. The trajectory carries the proxy's
per-session counts of prompts built from ids
(`prompt_from_ids`) and rendered in full (`re_rendered`).

The agent's client retries a request that failed before any response arrived on its connection (refused, reset,
or closed by the server before answering: a kept-alive connection the proxy had just closed), at most
`CONNECTION_RETRIES` times: one proxy error then costs at most that one request, not the agent's next one and
with it the episode (issue #30). Nothing else is retried (an HTTP error status, a read timeout): the proxy may
have sampled and recorded that turn. The openai client's own retries stay off (`max_retries=0`), as they would
also resend after 5xx answers and timeouts.

Returns are a trajectory and its summary per episode (Ray `num_returns=2` per episode, each its own object): the
driver reads the summaries and hands the trajectories' ObjectRefs to the learner untouched.
"""
from __future__ import annotations

import asyncio
import math
import os
import secrets
import traceback
from typing import Any

from rlsys.envs.base import DEFAULT_ENV, resolve_environment
from rlsys.proxy.sessions import ATTEMPT_HEADER, SESSION_HEADER
from rlsys.types import Trajectory, TrajectorySummary

CONNECTION_RETRIES = 2
RETRY_BACKOFF_S = (0.05, 0.25)


class EnvWorker:
    def __init__(self, agent_spec: str | None = None, reward_spec: str | None = None, *, env_name: str = DEFAULT_ENV,
                 agent_timeout_s: float, reward_timeout_s: float, max_concurrency: int = 64) -> None:
        # the environment by name (a worker resolves it itself: a user's file cannot travel pickled by reference),
        # with the old agent/reward plug-ins laid over it (rlsys/envs/base.py)
        env = resolve_environment(env_name, agent_spec, reward_spec)
        self.agent, self.reward, self.outcome = env.agent, env.reward, env.outcome
        self.episode_metrics = env.episode_metrics
        self.agent_timeout_s = agent_timeout_s
        self.reward_timeout_s = reward_timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)  # agents running at once, over all calls
        self._clients: dict[tuple[str, str], Any] = {}
        self._tokenizers: dict[str, Any] = {}
        # here, while the engines build, not in the first episode: the imports (~1 s here) and the client's lazily
        # loaded chat resource and response types (the first call took 0.14 s against 0.06 s after this)
        import httpx  # noqa: F401
        import httpx_aiohttp  # noqa: F401  (and aiohttp)
        import openai
        from openai.types.chat import ChatCompletion  # noqa: F401

        openai.AsyncOpenAI(api_key="warm-up", base_url="http://127.0.0.1:9/v1", max_retries=0).chat.completions

    def _client(self, base_url: str, token: str, session_id: str, attempt: str):
        import httpx
        import openai

        # one HTTP connection pool per proxy; the session id travels as a per-request header
        key = (base_url, token)
        if key not in self._clients:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            self._clients[key] = httpx.AsyncClient(timeout=httpx.Timeout(self.agent_timeout_s), trust_env=False,
                                                   transport=retrying_transport(limits))
        return openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, http_client=self._clients[key],
                                  default_headers={SESSION_HEADER: session_id, ATTEMPT_HEADER: attempt})

    async def run_episodes(self, proxy: dict[str, Any], episodes: list[tuple[dict[str, Any], int, int, str]]
                           ) -> list[Trajectory | TrajectorySummary]:
        """Episodes ``(item, group, sample, session_id)`` against one rollout actor's proxy (``proxy`` = {"url",
        "token", "model", "actor"}), in one Ray call: the agents run concurrently (at most ``max_concurrency`` of
        this worker's at once), their sessions are popped in one call to the rollout actor once all have returned,
        then each is scored. Returns trajectory, summary, trajectory, summary, ... in ``episodes``' order (Ray
        ``num_returns=2 * len(episodes)``).

        Why one call for many: a step of the CPU main job made 128 Ray calls (an episode, then its pop) for 64
        episodes, and 64 calls cost ~30 ms of its ~270 ms rollout (docs/performance.md, section 6)."""
        runs = await asyncio.gather(*[self._agent_run(proxy, item, group, sample, session_id)
                                      for item, group, sample, session_id in episodes])
        records = await proxy["actor"].pop_sessions.remote([(sid, attempt) for (*_, sid), (_, attempt, _) in
                                                           zip(episodes, runs)])
        await asyncio.gather(*[self._finish(traj, item, output, record)
                               for (item, *_), (traj, _, output), record in zip(episodes, runs, records)])
        return [x for traj, _, _ in runs for x in (traj, TrajectorySummary.of(traj))]

    async def _agent_run(self, proxy: dict[str, Any], item: dict[str, Any], group: int, sample: int,
                         session_id: str) -> tuple[Trajectory, str, Any]:
        """The agent's part of an episode: (trajectory, the attempt token of its requests, the agent's output)."""
        traj = Trajectory(item_id=str(item.get("id", "")), group=group, sample=sample)
        # a retry after this worker died mid-episode must not inherit the dead attempt's recorded turns
        attempt = secrets.token_hex(8)
        output: Any = None
        async with self._slots:
            client = self._client(proxy["url"], proxy["token"], session_id, attempt)
            try:
                output = await asyncio.wait_for(self.agent(item, client, proxy["model"]), self.agent_timeout_s)
            except asyncio.TimeoutError:
                _fail(traj, f"agent_timeout: no result after {self.agent_timeout_s:g} s")
            except Exception as err:  # the user's agent raised: the reason goes into metrics and the log
                _fail(traj, f"agent_error: {_describe(err)}")
        traj.info["output"] = output  # what the reward saw: kept for eval tables and debugging
        return traj, attempt, output

    async def _finish(self, traj: Trajectory, item: dict[str, Any], output: Any, record: Any) -> None:
        """The session's recorded turns into the trajectory, then the reward."""
        traj.segments = record.segments
        traj.num_turns = record.num_turns
        traj.segment_breaks = record.segment_breaks
        traj.prompt_from_ids = record.prompt_from_ids
        traj.re_rendered = record.re_rendered
        traj.truncated_turns = record.truncated_turns
        if not traj.failed:
            await self._score(traj, item, output)
        if not traj.failed and traj.num_turns == 0:
            _fail(traj, "no_turns: the agent returned without calling the model through the proxy")

    async def _score(self, traj: Trajectory, item: dict[str, Any], output: Any) -> None:
        record = {"item": item, "output": output}
        try:
            value = await asyncio.wait_for(asyncio.to_thread(self.reward, record), self.reward_timeout_s)
        except asyncio.TimeoutError:
            return _fail(traj, f"reward_timeout: no result after {self.reward_timeout_s:g} s")
        except Exception as err:  # the user's reward raised
            return _fail(traj, f"reward_error: {_describe(err)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _fail(traj, f"reward_invalid: returned {type(value).__name__} {value!r:.80}, expected a float")
        if not math.isfinite(value):
            return _fail(traj, f"reward_invalid: returned {value}")
        traj.reward = float(value)
        if self.outcome is not None:
            try:
                traj.outcome = str(self.outcome(record))
            except Exception as err:  # a broken labeller must not lose a valid reward
                traj.outcome = "unlabelled"
                traj.info["outcome_error"] = _describe(err)
        if self.episode_metrics is not None:
            try:
                traj.metrics = {str(k): float(v) for k, v in self.episode_metrics(record).items()}
            except Exception as err:  # as for the labeller: the reward stands, the metrics are dropped
                traj.info["episode_metrics_error"] = _describe(err)

    def sft_examples(self, episodes: list[tuple[dict[str, Any], int, int]], model_path: str
                     ) -> list[Trajectory | TrajectorySummary]:
        """SFT chats ``(item, group, sample)`` rendered by the model's chat template, the "episodes" of `--algo
        sft`: trajectory, summary, ... as ``run_episodes`` returns them."""
        from rlsys.sft import render_chat

        if model_path not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[model_path] = AutoTokenizer.from_pretrained(model_path)
        out: list[Trajectory | TrajectorySummary] = []
        for item, group, sample in episodes:
            traj = Trajectory(item_id=str(item.get("id", "")), group=group, sample=sample, outcome="sft",
                              num_turns=1)
            try:
                traj.segments = [render_chat(self._tokenizers[model_path], item.get("messages"), item.get("tools"))]
            except Exception as err:  # a malformed chat fails alone, with its reason
                _fail(traj, f"sft_item_error: item {traj.item_id!r}: {_describe(err)}")
            out += [traj, TrajectorySummary.of(traj)]
        return out

    async def close(self) -> None:
        """Close the agents' HTTP clients (their aiohttp sessions warn when collected open)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def retrying_transport(limits: Any) -> Any:
    """The agents' HTTP transport: aiohttp under httpx's interface (``httpx_aiohttp.AiohttpTransport``, the
    openai SDK's `aiohttp` option), resending a request whose connection failed before any response
    (``CONNECTION_RETRIES`` times, after ``RETRY_BACKOFF_S``).

    Why aiohttp: with 32 agents of a worker in flight at once, httpcore's connection pool scans every pooled
    connection (a socket poll each) whenever a request starts or ends; the agents' client cost 2.7 ms of CPU an
    episode, against 1.0 ms through aiohttp's connector (tic-tac-toe's first request, 32 at once, an instant
    proxy; docs/performance.md, section 6). ``handle_async_request`` returns once the response head is in, so
    every error it raises came before the proxy answered: either the request never reached the proxy, or it
    reached a connection the proxy had closed, which uvicorn does not read (aiohttp's errors arrive as httpx's:
    a connection the server closed is a ``ConnectTimeout``, a refused one a ``ConnectError``)."""
    import httpx
    from httpx_aiohttp import AiohttpTransport

    retried = (httpx.ConnectError, httpx.ConnectTimeout, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError)

    class RetryingTransport(AiohttpTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            for pause in RETRY_BACKOFF_S[:CONNECTION_RETRIES]:
                try:
                    return await super().handle_async_request(request)
                except retried:
                    await asyncio.sleep(pause)
            return await super().handle_async_request(request)

    return RetryingTransport(limits=limits, trust_env=False)


def _fail(traj: Trajectory, reason: str) -> None:
    traj.failed = True
    traj.fail_reason = reason


def _describe(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"[:500]
