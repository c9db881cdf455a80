"""Pure tensor functions for RL post-training: advantages, GSPO, GRPO, SFT losses, entropy/KL terms, token logprobs.

Tensors and a small frozen config in; a loss tensor and a ``dict[str, float]`` of metrics out.
No I/O, no Ray, no vLLM: everything here runs and is tested on CPU.
"""
from rlsys.algos.advantages import group_advantages
from rlsys.algos.grpo import GRPOConfig, grpo_loss, grpo_normalizer
from rlsys.algos.gspo import GSPOConfig, gspo_loss, gspo_normalizer
from rlsys.algos.logprobs import masked_mean, token_entropy, token_logprobs
from rlsys.algos.regularizers import (EntropyController, RegularizerConfig, decayed_kl_coef, kl_k3, regularizer_loss,
                                      top_entropy_mask)
from rlsys.algos.sft import sft_loss

__all__ = [
    "EntropyController",
    "GRPOConfig",
    "GSPOConfig",
    "RegularizerConfig",
    "decayed_kl_coef",
    "group_advantages",
    "grpo_loss",
    "grpo_normalizer",
    "gspo_loss",
    "gspo_normalizer",
    "kl_k3",
    "masked_mean",
    "regularizer_loss",
    "sft_loss",
    "token_entropy",
    "token_logprobs",
    "top_entropy_mask",
]
