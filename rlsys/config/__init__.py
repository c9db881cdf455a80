"""One typed config tree for an rlsys job: defaults < TOML file < CLI flags < dotted overrides.

Every field has a docstring (shown by ``rlsys train --help-config``). The tree is validated once, at
load, and a bad value fails with its dotted path and where it came from (file, flag or override), e.g.
``learner.lr: Input should be greater than 0 (from flag --lr=-1)``. The resolved tree is written into
the run directory as ``config.resolved.toml``; loading that file gives the same config back.

CLI flags follow AReno's names (``--algo gspo --ckpt ... --n-samples 4``) so existing launch scripts map
one to one; anything else is reachable as a dotted override ``algo.clip_eps_low=3e-4``.
"""
from rlsys.config.job import (CheckpointConfig, ClusterConfig, Config, EvalConfig, LoggingConfig, SyncConfig)
from rlsys.config.load import (FLAGS, add_config_args, config_from_args, describe_fields, dump_config, leaf_items,
                               load_config, read_toml)
from rlsys.config.sections import (AUTO_WORKERS_PER_NODE, ConfigError, DataConfig, EnvConfig, ModelConfig,
                                   RolloutConfig)
from rlsys.config.training import LORA_ALL_LINEAR, AlgoConfig, LearnerConfig, LoraConfig

__all__ = ["AUTO_WORKERS_PER_NODE", "FLAGS", "LORA_ALL_LINEAR", "AlgoConfig", "CheckpointConfig", "ClusterConfig",
           "Config", "ConfigError", "DataConfig", "EnvConfig", "EvalConfig", "LearnerConfig", "LoggingConfig",
           "LoraConfig", "ModelConfig", "RolloutConfig", "SyncConfig", "add_config_args", "config_from_args",
           "describe_fields", "dump_config", "leaf_items", "load_config", "read_toml"]
