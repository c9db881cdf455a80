"""One environment = one `Environment` object: what the framework needs from a task, typed and in one place.

An environment package exports `ENV = Environment(...)` (rlsys/envs/<name>/env.py for the built-in ones); the
job finds it by `env.name`: a built-in name (`ENVIRONMENTS`) or `package.module:ENV` / `path/to/file.py:ENV` for a
user's own. Nothing outside the environment knows what an item looks like, which outcomes exist, which rates
matter or how a prompt is perturbed; the framework asks this object (docs/CONTRACTS.md, "Environments").

The older plug-ins, `env.agent_fn` and `env.reward_fn_path` (`--agent-fn`, `--reward-fn-path`), still work:
`resolve_environment` lays them over the named environment, reading the reward file's optional `outcome`,
`OUTCOMES`, `validate_item`, `summarize` and `summarize_by_kind` as before (`with_plugins`, the one adapter).

Imports only the standard library and rlsys.plugins here; an environment's own modules load when it is resolved.
"""
from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from rlsys.plugins import PluginError, load_agent, load_attribute, load_reward

if TYPE_CHECKING:
    from rlsys.config import DataConfig

DEFAULT_ENV = "tictactoe"
DEFAULT_VARIANT = "default"  # the unperturbed prompt; no perturbation may take this name
# built-in environments: name -> where its Environment is
ENVIRONMENTS = {
    "tictactoe": "rlsys.envs.tictactoe.env:ENV",
    "tictactoe_game": "rlsys.envs.tictactoe_game.env:ENV",
    "ledger": "rlsys.envs.ledger.env:ENV",
    "gsm": "rlsys.envs.gsm.env:ENV",
    "mcp_calculator": "rlsys.envs.mcp_calculator.env:ENV",
}

Agent = Callable[[dict, Any, str], Awaitable[Any]]  # async (item, openai.AsyncOpenAI, model) -> output
ItemSource = Callable[["DataConfig"], list[dict]]  # the data section (sizes, seed) -> items
Perturbation = Callable[[list[dict]], list[dict]]  # held-out items -> the items of that variant (may be fewer)
Summary = Callable[[list[dict], list[str]], dict[str, float]]  # (items, outcome labels), same order -> rates


class Headline(NamedTuple):
    """The one success rate a run's summary follows beside the reward (`Environment.headline`)."""

    name: str  # e.g. "legal_move"
    outcomes: tuple[str, ...]  # the outcome labels that count as success in a sampled batch
    heldout_rate: str | None = None  # the evaluation rate (`summarize`'s key) that measures it on held-out items


@dataclass(frozen=True)
class Environment:
    """A task: how an episode runs and is scored, what its items are, how evaluation reads it."""

    name: str
    agent: Agent
    """`async def agent(item, client, model)`: one episode against the OpenAI-compatible proxy; returns a
    JSON-serialisable output (what `reward` gets as `record["output"]`)."""
    reward: Callable[[dict], float]
    """`reward(record) -> float`, record = {"item": item, "output": agent's output}; runs in the env worker."""
    outcomes: tuple[str, ...] = ()
    """Every label `outcome` gives, in report order (worst first by convention); logged as 0.0 when absent."""
    outcome: Callable[[dict], str] | None = None
    """`outcome(record) -> str`: the episode's error-table label; None = episodes go unlabelled."""
    validate_item: Callable[[dict], None] | None = None
    """Raises ValueError for a dataset line the environment cannot use (checked before the job starts)."""
    summarize: Summary | None = None
    """`summarize(items, outcomes) -> {rate: float}`: evaluation rates; a failed episode's outcome is "failed"."""
    train_items: ItemSource | None = None
    """The training items when `data.dataset_path` is unset (None: the job needs a dataset file)."""
    heldout_items: ItemSource | None = None
    """The held-out items when `data.eval_path` is unset (None: evaluation needs an eval file)."""
    sft_items: ItemSource | None = None
    """Chats `{"messages", "tools"}` for `algo.name = "sft"` when `data.dataset_path` is unset."""
    perturbations: Mapping[str, Perturbation] = field(default_factory=dict)
    """Held-out robustness variants (`rlsys eval --perturb`, `eval.perturb`): name -> held-out items -> the items
    that variant runs (e.g. tagged with `prompt_variant`, which the agent reads). Each is reported on its own."""
    episode_metrics: Callable[[dict], dict[str, float]] | None = None
    """`episode_metrics(record) -> {name: float}`: a few scalars per scored episode (e.g. tool calls made), averaged
    over a step's episodes as `episode/<name>` in the training metrics and in each evaluation variant's report."""
    headline: Headline | None = None
    """The success rate `rlsys recipe`'s summary and plot follow beside the reward: in each training batch the share
    of episodes whose outcome is one of `headline.outcomes`, and on held-out items the evaluation rate
    `headline.heldout_rate` (e.g. legal moves, `legal_move_rate`; math problems: right answers, `right_rate`).
    None: the summary follows the reward and the error table only."""
    first_request: Callable[[dict], dict] | None = None
    """For an agent that sends one chat completion per episode: that request's body without `model`,
    `{"messages", "tools"[, "tool_choice"]}`. Lets `rlsys tune` measure prompt lengths and `bench proxy` render the
    prompts itself. None: unknown outside the agent, or several turns (later ones are longer than the first)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("Environment: name must be a non-empty string")
        if not inspect.iscoroutinefunction(self.agent):
            raise ValueError(f"Environment {self.name!r}: agent must be `async def agent(item, client, model)`")
        if not callable(self.reward) or inspect.iscoroutinefunction(self.reward):
            raise ValueError(f"Environment {self.name!r}: reward must be a plain `def reward(record) -> float`")
        if DEFAULT_VARIANT in self.perturbations:
            raise ValueError(f"Environment {self.name!r}: {DEFAULT_VARIANT!r} is the unperturbed prompt, not a "
                             "perturbation name")
        if len(set(self.outcomes)) != len(self.outcomes):
            raise ValueError(f"Environment {self.name!r}: outcomes repeat a label: {self.outcomes}")
        if self.headline is not None and not set(self.headline.outcomes) <= set(self.outcomes):
            raise ValueError(f"Environment {self.name!r}: headline {self.headline.name!r} counts outcomes "
                             f"{sorted(set(self.headline.outcomes) - set(self.outcomes))} that `outcomes` does not list")

    def rates(self, items: list[dict], outcomes: list[str]) -> dict[str, float]:
        """`summarize(items, outcomes)` as floats; {} without a summary."""
        if self.summarize is None:
            return {}
        if len(items) != len(outcomes):
            raise ValueError(f"{self.name}: {len(items)} items but {len(outcomes)} outcomes")
        return {k: float(v) for k, v in self.summarize(items, outcomes).items()}

    def label_order(self, label: str) -> tuple[int, str]:
        """Sort key of an error-table label: `outcomes` order, other labels (failures) after, by name."""
        return label_order(label, self.outcomes)


def label_order(label: str, outcomes: tuple[str, ...]) -> tuple[int, str]:
    """Sort key of an error-table label under an environment's ``outcomes``: their order, other labels (failures)
    after, by name (`rlsys report` sorts a run's table by the outcomes its summary recorded)."""
    return (outcomes.index(label) if label in outcomes else len(outcomes), label)


def by_outcomes(summarize: Callable[[list[str]], dict[str, float]]) -> Summary:
    """A `summarize(outcomes)` that needs no items, as an `Environment.summarize`."""

    def summary(items: list[dict], outcomes: list[str]) -> dict[str, float]:
        return summarize(outcomes)

    return summary


def tagged(variant: str, applies: Callable[[dict], bool] | None = None) -> Perturbation:
    """A perturbation that runs the items (those ``applies`` accepts) with `"prompt_variant": variant`, for an
    agent and reward that read that key."""

    def perturbation(items: list[dict]) -> list[dict]:
        return [{**item, "prompt_variant": variant} for item in items if applies is None or applies(item)]

    return perturbation


def shipped_items(path: Any, validate: Callable[[dict], None] | None = None) -> ItemSource:
    """An item source that reads a JSONL file shipped with the environment (whatever the data section says)."""

    def source(data: DataConfig) -> list[dict]:
        from rlsys.data import read_jsonl

        return read_jsonl(path, validate=validate)

    return source


def seeded_items(make: Callable[[int, int], list[dict]]) -> ItemSource:
    """An item source from a `make(count, seed)` generator, given `data.num_items` and `data.seed`."""

    def source(data: DataConfig) -> list[dict]:
        return make(data.num_items, data.seed)

    return source


# --- finding an environment ---------------------------------------------------------------------------------
def load_environment(name: str) -> Environment:
    """A built-in environment by name, or `package.module[:ENV]` / `path/to/file.py[:ENV]`."""
    spec = ENVIRONMENTS.get(name, name)
    if spec == name and ":" not in name and not name.endswith(".py") and "." not in name:
        raise PluginError(f"env.name {name!r}: not a built-in environment ({', '.join(ENVIRONMENTS)}); a user's "
                          "environment is `package.module:ENV` or `path/to/file.py:ENV`")
    env = load_attribute(spec, "ENV", "environment", noun="Environment")
    if not isinstance(env, Environment):
        raise PluginError(f"environment {spec!r}: is a {type(env).__name__}, not an rlsys.envs.Environment")
    return env


def resolve_environment(name: str = DEFAULT_ENV, agent_fn: str | None = None,
                        reward_fn_path: str | None = None) -> Environment:
    """The job's environment: `name`'s, with the old agent and reward plug-ins laid over it when given. A config
    from before `env.name` names no environment but a built-in one's agent and reward (`rlsys.envs.gsm.agent:agent`,
    `rlsys.envs.gsm.reward:reward`): that environment, whole."""
    if name == DEFAULT_ENV and agent_fn and reward_fn_path:
        owners = {spec.split(".")[2] if spec.startswith("rlsys.envs.") else None for spec in (agent_fn, reward_fn_path)}
        if len(owners) == 1 and (owner := owners.pop()) in ENVIRONMENTS:
            name = owner
    env = load_environment(name)
    if agent_fn is None and reward_fn_path is None:
        return env
    return with_plugins(env, agent_fn, reward_fn_path)


def with_plugins(env: Environment, agent_fn: str | None, reward_fn_path: str | None) -> Environment:
    """``env`` with its agent and/or reward replaced by `--agent-fn` / `--reward-fn-path` plug-ins.

    A reward file brings what it defines of `outcome`, `OUTCOMES`, `validate_item`, `summarize(outcomes)` and
    `summarize_by_kind(items, outcomes)` (each absent one is absent: the environment's belong to its own reward).
    Another agent drops the environment's perturbations, first request and episode metrics (they describe its own
    agent and the records it returns). A plug-in
    that is the environment's own function changes nothing, so a resolved config naming them runs as before."""
    changes: dict[str, Any] = {}
    if agent_fn is not None:
        agent = load_agent(agent_fn)
        if agent is not env.agent:
            changes.update(agent=agent, perturbations={}, first_request=None, episode_metrics=None)
    if reward_fn_path is not None:
        reward, outcome = load_reward(reward_fn_path)
        if reward is not env.reward:
            module = sys.modules.get(reward.__module__)
            changes.update(reward=reward, outcome=outcome, outcomes=tuple(getattr(module, "OUTCOMES", ())),
                           validate_item=getattr(module, "validate_item", None), summarize=_module_summary(module),
                           headline=None)
    if not changes:
        return env
    return replace(env, name=f"{env.name}+plugins", **changes)


def _module_summary(module: Any) -> Summary | None:
    """A reward file's optional `summarize(outcomes)` and `summarize_by_kind(items, outcomes)`, as one summary."""
    totals = getattr(module, "summarize", None)
    by_kind = getattr(module, "summarize_by_kind", None)
    if totals is None and by_kind is None:
        return None

    def summary(items: list[dict], outcomes: list[str]) -> dict[str, float]:
        out = dict(totals(outcomes)) if totals is not None else {}
        if by_kind is not None:
            out.update(by_kind(items, outcomes))
        return out

    return summary
