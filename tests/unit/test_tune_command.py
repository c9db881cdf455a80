"""The `rlsys train` command `rlsys tune` suggests (jobs/tune.py): the job it tuned, the user's flags and dotted
overrides kept, its proposed values in their place."""
from __future__ import annotations

import argparse
import shlex



def _train_args(use_line: str) -> argparse.Namespace:
    """The suggested command's arguments, parsed as `rlsys train` parses them."""
    from rlsys.config import add_config_args

    words = shlex.split(use_line.removeprefix("use: "))
    assert words[:2] == ["rlsys", "train"], use_line
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser.parse_args(words[2:])


def test_the_suggested_command_keeps_the_users_overrides_with_the_proposed_values_in_their_place(qwen15b_folder,
                                                                                                   capsys):
    from jobs.tune import getattr_dotted, main
    from rlsys.config import config_from_args

    folder = qwen15b_folder
    user = ["rollout.max_model_len=1024", "rollout.kv_cache_gib=3", "seed=1", "learner.mini_bs=8",
            "model.gradient_checkpointing=false"]
    assert main(["--ckpt", str(folder), "--gpu-memory-budget-gib", "24", "--batch-size", "8", "--n-samples", "8",
                 "--prompt-tokens", "240", *user]) == 0
    out = capsys.readouterr().out
    use = [line for line in out.splitlines() if line.startswith("use: rlsys train")]
    changes = [line for line in out.splitlines() if line.startswith("changes: ")]
    assert use and changes, out
    # what tune proposes (`changes: key old -> new, ...`): the micro-batch or checkpointing, both named above
    proposed = dict((c.split(" ")[0], c.split(" -> ")[1]) for c in changes[0].removeprefix("changes: ").split(", "))
    assert set(proposed) & {"learner.mini_bs", "model.gradient_checkpointing"}, proposed

    args = _train_args(use[0])
    keys = [o.partition("=")[0] for o in args.overrides]
    assert len(keys) == len(set(keys)), f"a key twice: {use[0]}"
    # every override given, in order, each with tune's value where tune proposes one
    want = [f"{o.partition('=')[0]}={proposed.get(o.partition('=')[0], o.partition('=')[2])}" for o in user]
    assert args.overrides[:len(user)] == want, use[0]
    assert keys[len(user):] == [k for k in proposed if k not in keys[:len(user)]] + ["rollout.budget_prompt_tokens"]
    assert (getattr(args, "flag:--batch-size"), getattr(args, "flag:--n-samples")) == ("8", "8")

    # the command's config is the job tuned, with the proposal applied
    cfg = config_from_args(args)
    assert (cfg.seed, cfg.rollout.kv_cache_gib, cfg.rollout.max_model_len) == (1, 3.0, 1024)
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples, cfg.rollout.budget_prompt_tokens) == (8, 8, 240)
    assert (cfg.model.ckpt, cfg.rollout.gpu_memory_budget_gib) == (str(folder), 24.0)
    for key, value in proposed.items():
        assert str(getattr_dotted(cfg, key)).lower() == value, key


def test_train_command_writes_each_key_once_and_quotes_what_the_shell_would_split():
    from jobs.tune import train_command

    line = train_command("my configs/a.toml", {"--ckpt": "m", "--mini-bs": "8", "--adam-8bit": True,
                                               "--seed": None, "--gpu-memory-budget-gib": "24"},
                         ["learner.mini_bs=4", 'env.name="gsm"', "seed=1", "seed=2"], {"learner.mini_bs": 2})
    # --mini-bs names learner.mini_bs, which an override sets: the override alone, with tune's value
    assert shlex.split(line) == ["rlsys", "train", "--config", "my configs/a.toml", "--ckpt", "m", "--adam-8bit",
                                 "--gpu-memory-budget-gib", "24", "learner.mini_bs=2", 'env.name="gsm"', "seed=2"]
