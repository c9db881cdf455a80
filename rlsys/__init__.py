"""rlsys: single-node agentic RL post-training (GSPO/GRPO/SFT) on Ray, that scales out by asking Ray for GPUs.

`import rlsys` pulls in neither Ray nor vLLM: those live in actors/, jobs/ and lazily imported engine modules.
"""
__version__ = "0.1.0"
