"""The GPU generation engine: vLLM's `AsyncLLM` behind rlsys's `Engine` interface.

Token ids in, token ids + raw logprobs out. vLLM is imported only when a `VLLMEngine` is built, so this
module (and its helpers) import on machines without vLLM.

- Continuous batching: every `generate` is one vLLM request; concurrent calls from the proxy are batched by
  vLLM's scheduler. Each request carries its own seed (the proxy derives one per session and turn).
- Logprobs: the engine runs with `logprobs_mode="raw_logprobs"` and asks for `logprobs=0` (only the sampled
  token's), so `GenerateOutput.logprobs` are log_softmax of the raw logits at temperature 1, the quantity the
  learner recomputes, whatever temperature or top-p sampled the token. `score` uses `prompt_logprobs=0`
  (computed from the raw logits too; vLLM skips the prefix cache for such requests).
- Stop: at the model's eos ids (generation_config), the request's stop ids and stop strings; the stop token (or
  the token completing a stop string) stays in `token_ids`, as with the CPU engine. Temperature, top-p, penalties
  and logit bias map one to one onto vLLM's `SamplingParams` (vLLM too samples greedily below 1e-5).
- Sleep mode (`enable_sleep_mode`): `sleep(1)` offloads weights to CPU and drops the KV cache, `sleep(2)` drops
  both; `wake(["weights"])` then `wake(["kv_cache"])` lets the weight push land before the KV cache comes back.
  After `sleep(2)` the weights count as dropped until a push refilled every parameter: generating or scoring
  before that raises instead of serving garbage (vLLM #29341, TRL #5312).
- Weight push: the workers get a copy of the caller's transport once (`rlsys_set_transport`, actors/vllm_ext.py);
  then `load_payload` pickles the transport payload (CUDA IPC handles, or CPU buckets) and sends it
  to the worker extension in ONE `collective_rpc` for all buckets. One RPC per bucket
  pays off when the sender streams through one staging buffer, but `BucketPacker` keeps
  every bucket alive for reuse, so all handles are ready at once and one RPC pays the round trip (~1 ms) once.
  It is still one handle per bucket, never one RPC per tensor. For `collective` the payload is the bucket plan
  (first push only, else None) and the worker receives the buckets by NCCL broadcast during that RPC.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlsys.engines.base import WAKE_TAGS, Engine, GenerateOutput, SamplingParams, checked_prompt

log = logging.getLogger(__name__)

WORKER_EXTENSION = "actors.vllm_ext.WorkerExtension"
WEIGHTS_DROPPED = "weights dropped by sleep(level=2); push the weights (load_payload) before serving"
GIB = 1 << 30


# ------------------------------------------------------------------ memory budget (no vLLM needed)
def device_total_bytes() -> int:
    """Total memory of this process's first visible GPU, read through NVML when it is there, so that the
    rollout actor does not create a CUDA context (~0.5 GiB) just to size vLLM."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        import pynvml  # nvidia-ml-py, a vLLM dependency
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            if visible.startswith(("GPU-", "MIG-")):
                handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            else:
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        except pynvml.NVMLError as err:
            log.info("NVML could not size GPU %s (%s); asking torch instead", visible, err)
    return int(torch.cuda.get_device_properties(0).total_memory)


def memory_fraction(budget_gib: float | None, total_bytes: int, *, default_share: float = 1 / 3) -> float:
    """vLLM's `gpu_memory_utilization` for a budget in GiB (weights + activations + KV cache) on a device of
    ``total_bytes``; unset budget = ``default_share`` of the device. The learner owns the rest."""
    if total_bytes <= 0:
        raise ValueError(f"device total memory must be > 0, got {total_bytes}")
    if budget_gib is None:
        return default_share
    fraction = budget_gib * GIB / total_bytes
    if not 0 < fraction <= 0.95:
        raise ValueError(
            f"rollout.gpu_memory_budget_gib={budget_gib} is {fraction:.0%} of this GPU's "
            f"{total_bytes / GIB:.1f} GiB; keep it within (0, 95%] so the learner fits beside vLLM"
        )
    return fraction


# ------------------------------------------------------------------ the engine-core process (no vLLM needed)
# vLLM's AsyncLLM runs its engine core in a process of its own, and inside a Ray actor vLLM spawns it ("In a Ray
# actor and can only be spawned"): a fresh interpreter that imports torch and vLLM again after the actor did,
# ~15 s of an eager start on an H200 (docs/performance.md, section 5). A fork server started before the actor
# imports vLLM imports them meanwhile, in parallel; the engine core is then forked from it, already imported.
# Forking the server (a clean interpreter: no Ray threads, no CUDA) is as safe as spawning; a plain fork of the
# actor, which is what vLLM refuses, never happens.
ENGINE_CORE_PRELOAD = ("rlsys.engines.vllm_preload",)  # vLLM's engine core and AsyncLLM, guarded
PRELOAD_ARCHITECTURES_ENV = "RLSYS_PRELOAD_ARCHITECTURES"  # the server's only: vllm_preload imports their modules


class EnvironForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A fork-server child that runs with its parent's environment of the moment it was started, as a spawned
    one would: forked from the server, it would otherwise have the server's, from before vLLM set its own
    variables (RAY_ADDRESS, VLLM_WORKER_MULTIPROC_METHOD, ...) in the parent."""

    def start(self) -> None:
        self._parent_environ = dict(os.environ)  # pickled with the process object, read in `run`
        super().start()

    def run(self) -> None:
        environ = getattr(self, "_parent_environ", None)
        if environ is not None:
            os.environ.clear()
            os.environ.update(environ)
        super().run()


class EngineCoreContext(multiprocessing.context.ForkServerContext):
    Process = EnvironForkServerProcess


def model_architectures(model_path: str) -> tuple[str, ...]:
    """The ``architectures`` of the model's config.json; () without one (vLLM reports what it cannot load)."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            found = json.load(f).get("architectures") or ()
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(a for a in found if isinstance(a, str) and a.isidentifier())


def export_ray_address() -> str | None:
    """Where Ray is up (the rollout actor): RAY_ADDRESS = this cluster's GCS address in this process's environment, so that vLLM's
    engine-core process (forked from the fork server or spawned) and vLLM's Ray executor inside it join the job's
    Ray, where the job's placement group lives, instead of starting a Ray of their own. Returns the address (None
    without Ray: nothing to join, nothing set).

    vLLM sets the same variable in `get_mp_context`, but only on its way to forcing `spawn`: with
    VLLM_WORKER_MULTIPROC_METHOD=spawn already in the environment (a common setting, and the GPU tests' own) it
    returns before, and the engine core started a local Ray whose placement-group table lacked the job's group
    (`KeyError: 'bundles'` in `initialize_ray_cluster`). Called before the fork server starts, so the server
    and every child have it whatever `rollout.engine_process` is."""
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    address = ray.get_runtime_context().gcs_address
    os.environ["RAY_ADDRESS"] = address
    return address


MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def set_model_runner(choice: str) -> None:
    """`rollout.model_runner` into vLLM's variable: `v1` -> 0, `v2` -> 1, `auto` leaves what the environment says."""
    if choice not in ("auto", "v1", "v2"):
        raise ValueError(f"model_runner must be auto, v1 or v2, got {choice!r}")
    if choice != "auto":
        os.environ[MODEL_RUNNER_ENV] = "1" if choice == "v2" else "0"


COMPILE_CACHE_ENV = {"VLLM_CACHE_ROOT": "vllm", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def set_compile_caches(root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Point vLLM's, Triton's and Inductor's caches under ``root`` (default ${RLSYS_CACHE:-~/.cache/rlsys}/compile)
    in this process's environment, where a variable is not set already; the engine core (forked or spawned) and
    its workers inherit it. Call before vLLM is imported. Returns the variables as set."""
    from rlsys.models.tiny import default_cache_root  # noqa: PLC0415

    base = Path(root) if root is not None else default_cache_root() / "compile"
    for var, sub in COMPILE_CACHE_ENV.items():
        os.environ.setdefault(var, str(base / sub))
    return {var: os.environ[var] for var in COMPILE_CACHE_ENV}


def compilation_config(*, enforce_eager: bool, graph_mode: str, max_batch_size: int) -> dict[str, Any] | None:
    """vLLM's `compilation_config` for `rollout.graph_mode` (None: vLLM's defaults, as eager needs nothing).
    Graphs are captured for batch sizes up to ``max_batch_size``, the most sequences the engine runs at once."""
    if graph_mode not in ("compile", "full_decode"):
        raise ValueError(f"graph_mode must be compile or full_decode, got {graph_mode!r}")
    if enforce_eager:
        return None
    config: dict[str, Any] = {"max_cudagraph_capture_size": max_batch_size}
    if graph_mode == "full_decode":
        config.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")  # CompilationMode.NONE: no torch.compile
    return config


def start_engine_core_server(preload: Iterable[str] = ENGINE_CORE_PRELOAD,
                             architectures: Iterable[str] = ()) -> EngineCoreContext:
    """Start the fork server (it imports ``preload`` in the background; this returns at once). Call it before
    importing vLLM, with the environment the engine core should have (CUDA_VISIBLE_DEVICES, PYTHONPATH).
    ``architectures``: the model's (`model_architectures`), whose vLLM modules the default preload imports too;
    they reach the server in its environment, which is this process's again once it started."""
    set_compile_caches()
    ctx = EngineCoreContext()
    ctx.set_forkserver_preload(list(preload))
    before = os.environ.get(PRELOAD_ARCHITECTURES_ENV)
    os.environ[PRELOAD_ARCHITECTURES_ENV] = ",".join(architectures)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ[PRELOAD_ARCHITECTURES_ENV]
        else:
            os.environ[PRELOAD_ARCHITECTURES_ENV] = before
    return ctx


def run_pickled(payload: bytes, output_path: str) -> None:
    """A fork-server child's body for vLLM's model-registry probe: what `python -m
    vllm.model_executor.models.registry` does with the same cloudpickled function."""
    import cloudpickle  # noqa: PLC0415 (a vLLM dependency)

    try:
        from vllm.plugins import load_general_plugins  # noqa: PLC0415
    except ImportError:  # only a test runs this without vLLM
        pass
    else:
        load_general_plugins()
    fn = cloudpickle.loads(payload)
    with open(output_path, "wb") as f:
        pickle.dump(fn(), f)


def probe_in(ctx: multiprocessing.context.BaseContext):
    """vLLM's `_run_in_subprocess` (its model registry inspects a model class away from the CUDA-free parent,
    ~17 s on a fresh machine, where its cache ~/.cache/vllm/modelinfos is empty: a fresh interpreter importing
    torch and vLLM), run in a child of the fork server instead, which has them imported."""
    def run_in_subprocess(fn: Any) -> Any:
        import tempfile  # noqa: PLC0415

        import cloudpickle  # noqa: PLC0415

        with tempfile.TemporaryDirectory() as tmp:
            output = os.path.join(tmp, "registry_output.tmp")
            child = ctx.Process(target=run_pickled, args=(cloudpickle.dumps(fn), output), name="vllm-registry-probe")
            child.start()
            child.join()
            if child.exitcode != 0:
                raise RuntimeError(f"vLLM's model-registry probe failed in a fork-server child (exit code "
                                   f"{child.exitcode}; its traceback is in this actor's log)")
            with open(output, "rb") as f:
                return pickle.load(f)

    return run_in_subprocess


@contextlib.contextmanager
def engine_core_from(ctx: multiprocessing.context.BaseContext | None, engine_utils: Any = None,
                     registry: Any = None):
    """While building an AsyncLLM: vLLM starts its engine-core process, and runs its model-registry probe, in
    children of ``ctx`` (None: vLLM's own way). vLLM's `get_mp_context` still runs first, for what it sets in the
    environment. ``engine_utils``, ``registry``: the modules whose `get_mp_context` and `_run_in_subprocess` to
    replace (vllm.v1.engine.utils, vllm.model_executor.models.registry; tests pass stand-ins)."""
    if ctx is None:
        yield
        return
    if engine_utils is None:
        import vllm.v1.engine.utils as engine_utils  # noqa: PLC0415
    if registry is None:
        import vllm.model_executor.models.registry as registry  # noqa: PLC0415
    original = getattr(engine_utils, "get_mp_context", None)

    def get_mp_context() -> multiprocessing.context.BaseContext:
        original()  # vLLM's checks and environment (RAY_ADDRESS inside a Ray actor), carried to the child
        print("rlsys: vLLM's engine core is forked from rlsys's fork server, not spawned (rollout.engine_process)",
              flush=True)
        return ctx

    originals = []
    for module, name, new in [(engine_utils, "get_mp_context", get_mp_context),
                              (registry, "_run_in_subprocess", probe_in(ctx))]:
        if not hasattr(module, name):  # a vLLM that starts this process differently: that part goes vLLM's way
            log.warning("%s has no %s; vLLM starts that process its own way", getattr(module, "__name__", module), name)
            continue
        originals.append((module, name, getattr(module, name)))
        setattr(module, name, new)
    try:
        yield
    finally:
        for module, name, old in originals:
            setattr(module, name, old)


# ------------------------------------------------------------------ output helpers (no vLLM needed)
def logprob_of(entry: Any, token_id: int) -> float:
    """The logprob of ``token_id`` in one position of vLLM's logprobs (a dict of token id -> Logprob,
    or a FlatLogprobs position, which maps the same way)."""
    if entry is None:
        raise RuntimeError(f"vLLM returned no logprobs at the position of token {token_id}")
    try:
        item = entry[token_id]
    except (KeyError, IndexError):
        raise RuntimeError(f"vLLM's logprobs at this position lack the sampled token {token_id}") from None
    return float(getattr(item, "logprob", item))


def finish_reason(reason: str | None) -> str:
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"vLLM finished the request with {reason!r} (aborted, or the engine is going down)")


def _eos_ids(model_path: str) -> tuple[int, ...]:
    from transformers import AutoConfig, GenerationConfig  # noqa: PLC0415

    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the model config's eos
        eos = None
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "eos_token_id", None)
    if isinstance(eos, int):
        ids = [eos]
    elif eos is not None:
        ids = [int(e) for e in eos]
    return tuple(ids)


def lora_engine_args(rank: int, targets: Sequence[str]) -> dict[str, Any]:
    """vLLM's engine arguments for serving one adapter of ``rank`` on the modules ``targets`` (Hugging Face names:
    vLLM wraps the fused layer holding them, e.g. qkv_proj for q_proj) beside the base (`learner.lora.serve`)."""
    from rlsys.lora import slot_rank  # noqa: PLC0415

    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": slot_rank(rank),
            "lora_target_modules": list(targets)}


class VLLMEngine(Engine):
    """`Engine` over vLLM's `AsyncLLM`. Build it inside the event loop that will call it."""

    def __init__(
        self,
        model_path: str,
        *,
        max_batch_size: int = 64,
        seed: int = 0,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float,
        max_model_len: int,
        enforce_eager: bool,
        enable_sleep_mode: bool = True,
        enable_prefix_caching: bool = True,
        eos_token_ids: Iterable[int] | None = None,
        kv_cache_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        ray_executor: bool = False,
        process_context: multiprocessing.context.BaseContext | None = None,
        model_runner: str = "auto",
        graph_mode: str = "compile",
        lora_adapter: tuple[int, Sequence[str]] | None = None,
    ) -> None:
        """``ray_executor``: vLLM's workers as Ray actors (`distributed_executor_backend="ray"`), in the placement
        group of the Ray actor building this engine, on the bundles of `VLLM_RAY_BUNDLE_INDICES` with
        `VLLM_RAY_PER_WORKER_GPUS` of each (jobs/placement.py sets both in the actor's environment).
        ``process_context``: where the engine-core process comes from (`start_engine_core_server`; None: spawned
        or forked as vLLM decides). ``model_runner``: `v1`, `v2` or `auto` (vLLM's choice), set in this process's
        environment before vLLM reads it, so that its engine-core process and Ray workers inherit it.
        ``graph_mode``: `rollout.graph_mode` (`compilation_config`). ``lora_adapter``: (rank, target modules) of
        `learner.lora` with `serve = "adapter"`: vLLM's LoRA layers on those modules, one GPU slot, and every
        request names rlsys's adapter (registered by `set_lora`; rlsys/lora.py `LoraSlots`)."""
        set_model_runner(model_runner)
        set_compile_caches()
        compilation = compilation_config(enforce_eager=enforce_eager, graph_mode=graph_mode,
                                          max_batch_size=max_batch_size)
        from transformers import AutoConfig  # noqa: PLC0415
        from vllm import AsyncEngineArgs  # noqa: PLC0415

        try:
            from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415
        except ImportError:  # moved in a later release; the top-level alias stays
            from vllm import AsyncLLMEngine as AsyncLLM  # noqa: PLC0415

        args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_bytes,  # set: no start-up profiling (its use is then only a free-memory check)
            max_model_len=max_model_len,
            max_num_seqs=max_batch_size,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="raw_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="ray" if ray_executor else None,
            **({} if compilation is None else {"compilation_config": compilation}),
            **({} if lora_adapter is None else lora_engine_args(*lora_adapter)),
        )
        with engine_core_from(process_context):
            llm = AsyncLLM.from_engine_args(args)
        self.memory_fraction = gpu_memory_utilization  # the device share vLLM was given (the driver reads it)
        self._attach(
            llm, max_model_len=int(llm.model_config.max_model_len),
            vocab_size=int(AutoConfig.from_pretrained(model_path).get_text_config().vocab_size),
            eos_token_ids=tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(model_path),
            seed=seed, sleep_mode=enable_sleep_mode,
        )
        if lora_adapter is not None:
            from vllm.lora.request import LoRARequest  # noqa: PLC0415

            from rlsys.lora import ADAPTER_ID, ADAPTER_NAME, ADAPTER_PATH  # noqa: PLC0415

            self._lora_request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)

    @classmethod
    def around(cls, llm: Any, *, max_model_len: int, vocab_size: int, eos_token_ids: Iterable[int] = (),
               seed: int = 0, sleep_mode: bool = True) -> VLLMEngine:
        """An engine over an existing `AsyncLLM`-like object (tests drive the state logic with a fake)."""
        engine = cls.__new__(cls)
        engine._attach(llm, max_model_len=max_model_len, vocab_size=vocab_size,
                       eos_token_ids=tuple(eos_token_ids), seed=seed, sleep_mode=sleep_mode)
        return engine

    def _attach(self, llm: Any, *, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int,
                sleep_mode: bool) -> None:
        self.llm = llm
        self.max_model_len = max_model_len  # the proxy reads it
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.sleep_mode = sleep_mode
        self.last_load: dict[str, Any] = {}  # the worker's report of the latest push (path, timings)
        self._workers_transport: Any = None  # the transport whose copy the workers receive by
        self._seed_rng = torch.Generator().manual_seed(seed)  # seeds for requests that name none
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(3)
        self._asleep: set[str] = set()
        self._weights_dropped = False
        self._missing_after_push: list[str] = []
        self._closed = False
        self._lora_request: Any = None  # the adapter every request names (`lora_adapter`), once registered
        self._lora_serving = False  # set_lora done with vLLM's LoRA layers: requests carry `_lora_request`

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self._check_serving()
        prompt = checked_prompt(prompt_ids, self.vocab_size, params.max_new_tokens, self.max_model_len,
                                "the engine's max_model_len")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        from vllm import SamplingParams as VllmSamplingParams  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        sampling = VllmSamplingParams(
            n=1, max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, seed=seed,
            stop_token_ids=sorted(set(params.stop_token_ids) | set(self.eos_token_ids)), logprobs=0,
            # stop strings need vLLM's detokenizer; the token completing one stays in token_ids
            stop=list(params.stop), detokenize=bool(params.stop),
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            logit_bias=dict(params.logit_bias) or None, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = await self._run(prompt, sampling)
        completion = final.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(completion.logprobs or [])} logprobs for {len(token_ids)} tokens")
        logprobs = [logprob_of(entry, tok) for entry, tok in zip(completion.logprobs, token_ids)]
        return GenerateOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason(completion.finish_reason))

    async def score(self, prompt_ids: list[int], continuation_ids: list[int]) -> list[float]:
        self._check_serving()
        prompt, continuation = self._checked_score_ids(prompt_ids, continuation_ids)
        if not continuation:
            return []
        total = len(prompt) + len(continuation) + 1  # vLLM samples one token after the prompt
        if total > self.max_model_len:
            raise ValueError(f"{total - 1} tokens (+1 sampled) exceed the engine's max_model_len ({self.max_model_len})")
        from vllm import SamplingParams as VllmSamplingParams  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        sampling = VllmSamplingParams(n=1, max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                      output_kind=RequestOutputKind.FINAL_ONLY)
        final = await self._run(prompt + continuation, sampling)
        plp = final.prompt_logprobs
        if plp is None or len(plp) != total - 1:
            raise RuntimeError(f"vLLM returned {len(plp or [])} prompt logprobs for {total - 1} tokens")
        return [logprob_of(plp[len(prompt) + k], tok) for k, tok in enumerate(continuation)]

    async def _run(self, prompt: list[int], sampling: Any) -> Any:
        final = None
        request_id = f"rlsys-{self._id_prefix}-{next(self._ids)}"
        lora = self._lora_request if self._lora_serving else None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, sampling, request_id, lora_request=lora):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM request {request_id} ended without output")
        return final

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        raise NotImplementedError(
            "VLLMEngine's weights live in vLLM's engine process: use `await load_payload(transport, payload)` "
            "(rlsys.weights.transport)"
        )

    async def load_payload(self, transport: Any, payload: Any) -> int:
        """Forward a transport payload to the worker extension in one RPC; returns the tensors loaded."""
        self._check_open()
        if "weights" in self._asleep:
            raise RuntimeError("load_payload: the weights are asleep; wake(['weights']) before pushing")
        from rlsys.weights.transport import WeightTransport

        if not isinstance(transport, WeightTransport):
            raise ValueError(f"VLLMEngine cannot receive weights through {transport!r}: not a weight transport "
                             "(rlsys.weights.transport.WeightTransport)")
        if transport is not self._workers_transport:  # once per transport: the workers keep their copy's caches
            await self.llm.collective_rpc("rlsys_set_transport", args=(pickle.dumps(transport),))
            self._workers_transport = transport
        loop = asyncio.get_running_loop()
        start = loop.time()
        blob = pickle.dumps(payload)
        pickled = loop.time()
        results = await self.llm.collective_rpc("rlsys_load_weights", args=(blob,))
        counts = sorted({int(r["count"]) for r in results})
        if len(counts) != 1:
            raise RuntimeError(f"weight push: vLLM workers loaded different numbers of tensors: {counts}")
        info = dict(results[0])
        info["pickle_ms"], info["rpc_ms"] = (pickled - start) * 1e3, (loop.time() - pickled) * 1e3
        self.last_load = info
        missing = info.get("missing") or []
        if missing:
            log.warning("weight push left %d vLLM parameter(s) unloaded, e.g. %s", len(missing), missing[:5])
        self._missing_after_push = list(missing)
        if counts[0] > 0 and not missing:
            self._weights_dropped = False
        return counts[0]

    async def set_lora(self, scale: float) -> None:
        """Pushes from now on carry LoRA adapters (actors/vllm_ext.py `rlsys_set_lora`): built with
        ``lora_adapter``, the workers register a zero adapter in vLLM's LoRA slot, every request from now on names
        it, and pushes write into that slot; otherwise the workers merge pushes into their weights in place."""
        self._check_open()
        serve = "merged" if self._lora_request is None else "adapter"
        await self.llm.collective_rpc("rlsys_set_lora", args=(float(scale), serve))
        self._lora_serving = serve == "adapter"
        if self._lora_serving:  # cached prefixes were computed without the adapter (the key is its name)
            await self.llm.reset_prefix_cache()

    async def weights_fingerprint(self) -> dict[str, int] | None:
        """The bit sums of what the last push wrote, by HF name (actors/vllm_ext.py `rlsys_fingerprint`: the
        parameters' views of the direct-copy plan, or the LoRA adapters last merged); None when any worker cannot
        tell (no plan yet or refused, tensor parallel) or the weights were dropped."""
        self._check_open()
        if self._weights_dropped:
            return None
        results = list(await self.llm.collective_rpc("rlsys_fingerprint"))
        return results[0] if len(results) == 1 else None

    async def worker_devices(self) -> list[dict[str, Any]]:
        """Where each vLLM worker's weights live, in worker order: {"gpu_uuid", "node_id"} (the driver matches
        them with the learner ranks' to choose the weight transport)."""
        self._check_open()
        return list(await self.llm.collective_rpc("rlsys_device"))

    async def fetch_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of the engine's parameters under vLLM's names (q/k/v fused as qkv_proj, gate/up as
        gate_up_proj); for tests and checks, not for the hot path."""
        self._check_open()
        results = await self.llm.collective_rpc("rlsys_get_weights", args=(names,))
        return pickle.loads(results[0])

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        raise NotImplementedError("VLLMEngine: the weights live in vLLM's engine process; `await fetch_weights()`")

    # ------------------------------------------------------------------ memory
    async def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._check_open()
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine was built with enable_sleep_mode=False")
        if self._asleep:
            raise RuntimeError(f"engine already asleep ({sorted(self._asleep)}); wake() first")
        await self.llm.sleep(level)
        self._asleep = set(WAKE_TAGS)
        if level == 2:
            self._weights_dropped = True

    async def wake(self, tags: list[str] | None = None) -> None:
        tags = self._checked_wake_tags(tags)
        todo = [t for t in WAKE_TAGS if t in tags and t in self._asleep]  # weights first, as vLLM needs
        if not todo:
            return  # waking what is awake would map vLLM's memory twice
        await self.llm.wake_up(tags=todo)
        self._asleep.difference_update(todo)

    async def reset_prefix_cache(self) -> None:
        self._check_open()
        await self.llm.reset_prefix_cache()

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.llm.shutdown()

    # ------------------------------------------------------------------ checks
    def _check_serving(self) -> None:
        self._check_open()
        if self._weights_dropped:
            detail = f" ({len(self._missing_after_push)} parameters missing after the last push, e.g. " \
                     f"{self._missing_after_push[:3]})" if self._missing_after_push else ""
            raise RuntimeError(WEIGHTS_DROPPED + detail)
        if self._asleep:
            raise RuntimeError(f"engine is asleep ({sorted(self._asleep)}); call wake() first")
