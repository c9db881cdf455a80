"""An Engine that answers from a script, for proxy and multi-turn tests that need exact sampled tokens."""
from __future__ import annotations

import asyncio
from typing import Any

from rlsys.engines.base import Engine, GenerateOutput, SamplingParams


class ScriptedEngine(Engine):
    """`generate` answers the next scripted (text, end) in order: text encoded, then the end token
    (<|im_end|>, <|endoftext|>, or None for a cut by max_tokens). Logprobs -0.01 * position.

    Every call's prompt and params are kept in `calls`; `gate`, when set, holds every call until it is set.
    A script that runs out raises IndexError, unless `repeat_last`: then its last entry answers every
    later call."""

    def __init__(self, tokenizer: Any, script: list[tuple[str, str | None]], *, repeat_last: bool = False) -> None:
        self.tokenizer, self.script, self.repeat_last = tokenizer, list(script), repeat_last
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.gate: asyncio.Event | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        self.calls.append((list(prompt_ids), params))
        if self.gate is not None:
            await self.gate.wait()
        keep_last = self.repeat_last and len(self.script) == 1
        text, end = self.script[0] if keep_last else self.script.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if end is not None:
            ids.append(self.tokenizer.convert_tokens_to_ids(end))
        return GenerateOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop" if end else "length")

    async def score(self, prompt_ids, continuation_ids):
        raise NotImplementedError

    def load_weights(self, named_tensors):
        raise NotImplementedError
