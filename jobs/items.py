"""The job's items, checked before Ray starts: plug-ins, the training and held-out data, the memory budget.

`preflight` refuses what it can before any process starts (exit 2 with one line, `rlsys.errors.UserInputError`);
`load_items` and `load_eval_items` are also what `rlsys eval` and the scripts use to get the same items.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlsys.config import Config, ConfigError, DataConfig
from rlsys.data import DatasetError, read_jsonl
from rlsys.errors import UserInputError
from rlsys.models.resolve import resolve_model

if TYPE_CHECKING:
    from rlsys.envs.base import Environment


def item_validator(algo: str, env: Environment):
    """What every dataset line must satisfy: an SFT chat (``algo`` sft), or the environment's `validate_item`."""
    return validate_chat if algo == "sft" else env.validate_item


def validate_chat(item: dict[str, Any]) -> None:
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("an SFT item needs a non-empty 'messages' list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}]: needs a role of system, user, assistant or tool")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message to learn")


def preflight(cfg: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Everything that can be refused before Ray starts: the environment and its plug-ins, training and held-out
    data, a KV cache too small for one sequence, a memory budget the job does not fit."""
    env = cfg.env.environment()
    items = load_items(cfg.data, cfg.algo.name, env)
    check_kv_cache(cfg)
    check_memory_budget(cfg, items)
    wants_eval = cfg.eval.at_start or cfg.eval.at_end or cfg.eval.every
    return items, load_eval_items(cfg.data, cfg.algo.name, env) if wants_eval else []


def engine_is_vllm(cfg: Config) -> bool:
    """Whether the job's engine is vLLM, as this machine tells (`resolve_engine_kind` with NVML for the GPU: the driver
    does not import torch). The transformers engine ignores vLLM's settings (`rollout.kv_cache_gib`)."""
    from rlsys.engines import resolve_engine_kind
    from rlsys.memory import device_total_bytes_nvml

    return resolve_engine_kind(cfg.rollout.engine, lambda: device_total_bytes_nvml() is not None) == "vllm"


def check_kv_cache(cfg: Config) -> None:
    """`rollout.kv_cache_gib` on the vLLM engine, with or without a budget: refuse (ConfigError, exit 2: the size
    one `max_model_len` sequence needs with this model, and the fix) a KV cache vLLM would refuse in its engine's
    start, minutes later with Ray and the actors up (rlsys/budget.py `kv_cache_refusal`)."""
    if cfg.rollout.kv_cache_gib is None or not engine_is_vllm(cfg):
        return
    from rlsys.budget import kv_cache_refusal
    from rlsys.memory import JobShape, ModelShape, read_model_config

    model_path = resolve_model(cfg.model.ckpt)
    try:
        shape = ModelShape.from_config(read_model_config(model_path))
    except ValueError as err:  # a model whose config.json the estimate does not read: vLLM's own check stands
        print(f"rlsys: rollout.kv_cache_gib not checked against one sequence ({err})", flush=True)
        return
    refusal = kv_cache_refusal(shape, JobShape.from_config(cfg), cfg.cluster.tp_size)
    if refusal is not None:
        raise ConfigError(refusal)


def check_memory_budget(cfg: Config, items: list[dict[str, Any]] | None = None) -> None:
    """`rollout.gpu_memory_budget_gib`: estimate the co-located job's GPU memory (rlsys/memory.py) and refuse it
    (ConfigError, exit 2: the estimate table and settings that fit) if it is over the budget or the device.
    Measures the prompt length first (into `rollout.budget_prompt_tokens`, unless set), as `rlsys tune` does,
    so that a budget tune proposes passes here and the learner and the engines split it by the same estimate."""
    if cfg.rollout.gpu_memory_budget_gib is None:
        return
    from rlsys.budget import check_budget
    from rlsys.memory import GIB, MemoryBudgetError, device_total_bytes_nvml

    model_path = resolve_model(cfg.model.ckpt)
    prompt = "given"
    if cfg.rollout.budget_prompt_tokens is None:
        try:
            cfg.rollout.budget_prompt_tokens = measured_prompt_tokens(cfg, model_path, items)
            prompt = "measured" if cfg.rollout.budget_prompt_tokens else "unknown: sequences of max_model_len"
        except Exception as err:  # noqa: BLE001 (PromptsNotMeasured, or a template that fails: the worst case, said)
            prompt = f"not measured ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); " \
                     "sequences of max_model_len"
    try:
        est = check_budget(cfg, model_path, device_total_bytes_nvml())
    except MemoryBudgetError as err:
        raise ConfigError(str(err)) from None
    split = est.split()
    tokens = cfg.rollout.budget_prompt_tokens
    print(f"rlsys: memory budget {cfg.rollout.gpu_memory_budget_gib:g} GiB: estimated {est.total_bytes / GIB:.1f} GiB "
          f"(learner {est.learner_bytes / GIB:.1f}, engine {est.engine_bytes / GIB:.1f}); shares: learner "
          f"{split.learner_bytes / GIB:.1f} GiB, engine {split.engine_bytes / GIB:.1f} GiB; prompts "
          f"{f'{tokens} tokens, ' if tokens else ''}{prompt}", flush=True)


MEASURED_ITEMS = 64  # the training items whose prompts `measured_prompt_tokens` renders
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a vocabulary: fast, SentencePiece, BPE


class PromptsNotMeasured(UserInputError):
    """The model gives no tokenizer with a chat template to measure the prompts with; the message names it."""


def measured_prompt_tokens(cfg: Config, model_path: str, items: list[dict[str, Any]] | None = None) -> int | None:
    """The longest prompt (chat template + tools) over the first `MEASURED_ITEMS` training items (``items``, or
    loaded), in the model's tokens, for an environment whose agent sends one request per episode
    (`Environment.first_request`); None otherwise (multi-turn or unknown prompts) and for SFT.
    PromptsNotMeasured where the model has no tokenizer or chat template (`prompt_tokenizer`)."""
    env = cfg.env.environment()
    if env.first_request is None or cfg.algo.name == "sft":
        return None
    tokenizer = prompt_tokenizer(model_path)
    if items is None:
        items = load_items(cfg.data.model_copy(update={"num_items": min(cfg.data.num_items, MEASURED_ITEMS)}),
                           cfg.algo.name, env)
    return max(len(p) for p in first_prompts(env, items[:MEASURED_ITEMS], tokenizer))


def first_prompts(env: Environment, items: list[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """The prompt ids the proxy renders for the environment's first request on each item
    (`Environment.first_request`; ValueError where the environment does not say what it is)."""
    from rlsys.proxy.schema import ChatCompletionRequest, template_messages, template_tools

    if env.first_request is None:
        raise ValueError(f"environment {env.name!r} does not give its first request (Environment.first_request)")
    out = []
    for item in items:
        req = ChatCompletionRequest.model_validate({"model": "m", **env.first_request(item)})
        ids = tokenizer.apply_chat_template(template_messages(req), tools=template_tools(req),
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append([int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)])
    return out


def prompt_tokenizer(model_path: str) -> Any:
    """The model's tokenizer, which renders the prompts as the proxy does, or PromptsNotMeasured saying what the
    model lacks. A folder without vocabulary files is refused before transformers sees it: from a config.json alone
    it builds an empty tokenizer and fails only at the chat template, in a traceback that names neither."""
    why = "the prompt length is measured with the model's tokenizer and chat template"
    path = Path(model_path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise PromptsNotMeasured(f"{model_path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); {why}")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:  # a broken or unreachable tokenizer: its first line says which
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise PromptsNotMeasured(f"{model_path}: its tokenizer does not load ({type(err).__name__}: {first}); "
                                 f"{why}") from err
    if not tokenizer.chat_template:
        raise PromptsNotMeasured(f"{model_path}'s tokenizer has no chat template (chat_template.jinja, or "
                                 f"chat_template in tokenizer_config.json); {why}")
    return tokenizer


def load_items(data: DataConfig, algo: str, env: Environment) -> list[dict[str, Any]]:
    """Training items: the dataset file (checked by `item_validator`), or the environment's own (its SFT chats
    for ``algo`` sft)."""
    if data.dataset_path:
        return read_jsonl(data.dataset_path, validate=item_validator(algo, env))
    source = env.sft_items if algo == "sft" else env.train_items
    if source is None:
        raise DatasetError(f"data.dataset_path: environment {env.name!r} has no built-in "
                           f"{'SFT chats' if algo == 'sft' else 'training items'}; give a JSONL file")
    return source(data)


def load_eval_items(data: DataConfig, algo: str, env: Environment) -> list[dict[str, Any]]:
    """Held-out items: the eval file (checked by the environment's `validate_item`), or the environment's own."""
    if data.eval_path:
        return read_jsonl(data.eval_path, validate=env.validate_item)
    if data.dataset_path and algo != "sft":
        raise DatasetError("data.eval_path: evaluating on a custom dataset needs its own held-out file")
    if env.heldout_items is None:
        raise DatasetError(f"data.eval_path: environment {env.name!r} has no built-in held-out items; give a "
                           "JSONL file")
    return env.heldout_items(data)
