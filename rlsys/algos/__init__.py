"""Pure tensor functions for RL post-training: advantages, GSPO, GRPO, SFT losses, token logprobs.

Tensors and a small frozen config in; a loss tensor and a ``dict[str, float]`` of metrics out.
No I/O, no Ray, no vLLM: everything here runs and is tested on CPU.
"""
from rlsys.algos.advantages import group_advantages
from rlsys.algos.grpo import GRPOConfig, grpo_loss, grpo_normalizer
from rlsys.algos.gspo import GSPOConfig, gspo_loss, gspo_normalizer
from rlsys.algos.logprobs import masked_mean, token_logprobs
from rlsys.algos.sft import sft_loss

__all__ = [
    "GRPOConfig",
    "GSPOConfig",
    "group_advantages",
    "grpo_loss",
    "grpo_normalizer",
    "gspo_loss",
    "gspo_normalizer",
    "masked_mean",
    "sft_loss",
    "token_logprobs",
]
