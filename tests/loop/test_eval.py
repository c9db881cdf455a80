"""`rlsys eval` under a real local Ray: a rollout actor + env workers, the proxy and the tool-call path.

The model under test is the tiny model overfit in this file's fixture (in-process SFT, a few hundred
optimizer steps on one sequence, no Ray) to answer every board with `choose_square(5)`. Its rates are
then known exactly from the boards: valid calls 100%, legal = boards with square 5 free, and so on, so
the test checks the whole path (agent -> proxy -> engine -> parser -> reward -> error table) against
arithmetic, not against "some number came out".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

FIXED_SQUARE = 5


def train_fixed_move_model(out_dir: Path, square: int = FIXED_SQUARE, max_steps: int = 400) -> Path:
    """The tiny model, overfit to answer any tic-tac-toe board with `choose_square(square)`; saved as an HF folder.

    Plain PyTorch on the SFT chats of `rlsys.envs.tictactoe.sft_data` (the masked assistant turn only), one
    thread (the 2-core CI box is shared), until the loss on the answer is ~0: ~110 steps, ~15 s here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlsys.envs.tictactoe.dataset import make_dataset
    from rlsys.envs.tictactoe.prompt import CHOOSE_SQUARE_TOOL
    from rlsys.envs.tictactoe.sft_data import sft_item
    from rlsys.models.tiny import ensure_tiny_model
    from rlsys.sft import render_chat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        base = ensure_tiny_model()
        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        segs = [render_chat(tok, sft_item(it, square)["messages"], [CHOOSE_SQUARE_TOOL]) for it in make_dataset(4, 0)]
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        loss = float("inf")
        for step in range(max_steps):
            seg = segs[step % len(segs)]
            ids = torch.tensor([seg.input_ids])  # (1, T)
            labels = ids.masked_fill(torch.tensor([seg.loss_mask]) == 0, -100)  # (1, T)
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            loss = out.loss.item()
            if loss < 0.01:
                break
        assert loss < 0.05, f"fixture: the tiny model did not learn choose_square({square}) (loss {loss:.3f})"
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def session_fixed_model(tmp_path_factory) -> Path:
    """One fixed-move model per pytest session, shared by this file and test_play.py (built once)."""
    out = tmp_path_factory.getbasetemp() / "fixed-move-model"
    if not (out / "DONE").is_file():
        train_fixed_move_model(out)
        (out / "DONE").write_text("ok\n")
    return out


@pytest.fixture(scope="module")
def fixed_model(tmp_path_factory) -> Path:
    return session_fixed_model(tmp_path_factory)


def _expected(boards: list[str]) -> dict[str, float]:
    from rlsys.envs.tictactoe import game

    labels = [game.move_outcome(b, FIXED_SQUARE) for b in boards]
    n = len(boards)
    return {"valid_call_rate": 1.0,
            "legal_move_rate": sum(lab in ("legal_suboptimal", "optimal", "win") for lab in labels) / n,
            "optimal_move_rate": sum(lab in ("optimal", "win") for lab in labels) / n,
            "win_move_rate": sum(lab == "win" for lab in labels) / n,
            "rewards_mean": sum(game.SCORE_BY_OUTCOME[lab] for lab in labels) / n}


def test_eval_rates_of_a_model_that_always_plays_5_match_the_boards(ray_local, fixed_model):
    from jobs.items import load_eval_items
    from jobs.eval import EvalRequest, format_table, run_eval
    from rlsys.config import load_config
    from rlsys.envs.tictactoe import game
    from rlsys.envs.tictactoe.prompt import PERTURBATIONS

    n = 8
    report = run_eval(EvalRequest(ckpt=str(fixed_model), n=n, perturb=True,
                                  overrides=["logging.progress=false", "rollout.max_new_tokens=32"]))
    default = load_config()
    held_out = load_eval_items(default.data, default.algo.name, default.env.environment())
    boards = [it["board"] for it in held_out[:n]]
    assert report["num_items"] == n and "tictactoe environment's held-out items" in report["items"]
    assert list(report["variants"]) == ["default", *PERTURBATIONS]

    default = report["variants"]["default"]
    for key, value in _expected(boards).items():
        assert default[key] == pytest.approx(value), f"default prompt: {key}"
    for example in report["examples"]["default"]:
        (call,) = example["output"]["tool_calls"]
        assert json.loads(call["arguments"]) == {"square": FIXED_SQUARE}

    for name, v in report["variants"].items():  # every variant: a consistent error table over n episodes
        assert v["episodes"] == n, name
        assert sum(v["errors"].values()) == pytest.approx(1.0), name
        assert v["win_move_rate"] <= v["optimal_move_rate"] <= v["legal_move_rate"] <= v["valid_call_rate"], name

    labels = [game.move_outcome(b, FIXED_SQUARE) for b in boards]  # by kind of board, counted here by hand
    success = {"win": ("win",), "block": ("optimal",), "lost": ("legal_suboptimal", "optimal", "win"),
               "other": ("optimal",)}
    rate_key = {"win": "win_taken_rate", "block": "block_rate", "lost": "lost_legal_rate", "other": "other_optimal_rate"}
    for kind in game.BOARD_KINDS:
        mine = [lab for b, lab in zip(boards, labels) if game.board_kind(b) == kind]
        assert default[f"{kind}_episodes"] == len(mine), kind
        if mine:
            assert default[rate_key[kind]] == pytest.approx(sum(lab in success[kind] for lab in mine) / len(mine)), kind
        else:
            assert rate_key[kind] not in default, kind

    table = format_table(report)
    assert "legal_move_rate" in table and "tool_renamed" in table and "no_tool_call" in table
    assert "by kind: win" in table and "win_taken_rate" in table


def test_prompt_variant_items_get_the_perturbed_chat_and_plain_items_the_training_chat():
    from rlsys.envs.tictactoe.agent import item_messages
    from rlsys.envs.tictactoe.prompt import PERTURBATIONS, messages_for, perturbed_messages

    board = "X...O...."
    assert item_messages({"board": board}) == messages_for(board)
    assert item_messages({"board": board, "prompt_variant": "default"}) == messages_for(board)
    for variant in PERTURBATIONS:
        assert item_messages({"board": board, "prompt_variant": variant}) == perturbed_messages(board, variant)
        assert item_messages({"board": board, "prompt_variant": variant}) != messages_for(board)
    with pytest.raises(ValueError, match="unknown prompt variant"):
        item_messages({"board": board, "prompt_variant": "nope"})


def test_cli_writes_json_for_the_untrained_tiny_model(ray_local, tmp_path, capsys):
    from jobs.eval import main
    from rlsys.envs.tictactoe.dataset import make_dataset, write_dataset

    boards = tmp_path / "boards.jsonl"
    write_dataset(make_dataset(3, 99), boards)
    out = tmp_path / "eval.json"
    rc = main(["--boards", str(boards), "--json", str(out), "logging.progress=false", "rollout.max_new_tokens=16"])
    assert rc == 0
    report = json.loads(out.read_text())
    (only,) = report["variants"].values()
    assert only["episodes"] == 3 and report["items"] == str(boards)
    assert sum(only["errors"].values()) == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "valid_call_rate" in printed and "error table" in printed


def test_bad_boards_file_is_one_line_and_exit_2(tmp_path, capsys):
    from jobs.eval import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "board": "XXXXXXXXX"}\n')
    assert main(["--boards", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "rlsys eval:" in err and "bad.jsonl:1" in err


def test_run_directory_resolves_to_its_latest_checkpoint(tmp_path):
    from jobs.eval import resolve_ckpt

    ckpts = tmp_path / "run" / "checkpoints"
    for step in ("step_000002", "step_000004"):
        (ckpts / step).mkdir(parents=True)
        (ckpts / step / "config.json").write_text("{}")
    (ckpts / "latest").write_text("step_000004\n")
    assert resolve_ckpt(str(tmp_path / "run")) == str(ckpts / "step_000004")
    assert resolve_ckpt(str(ckpts)) == str(ckpts / "step_000004")
    assert resolve_ckpt(str(ckpts / "step_000002")) == str(ckpts / "step_000002")
    assert resolve_ckpt("rlsys:tiny") == "rlsys:tiny"


def test_in_job_eval_with_perturb_reports_every_variant(ray_local, fixed_model, tmp_path):
    """`eval.perturb` in a training job: the default prompt under eval/*, each perturbation under
    eval/<variant>/*, each over the same held-out boards (the fixed model plays 5 whatever the prompt)."""
    from jobs.items import load_eval_items
    from jobs.train import run_training
    from rlsys.envs.tictactoe.prompt import PERTURBATIONS
    from rlsys.metrics import read_metrics
    from tests.conftest import job_config

    n = 6
    cfg = job_config(tmp_path, "eval.at_start=true", "eval.perturb=true", f"data.num_eval_items={n}",
                     "rollout.max_new_tokens=32", max_steps="1", ckpt=str(fixed_model))
    run_dir = run_training(cfg)
    (row,) = read_metrics(run_dir / "eval.jsonl")
    assert row["tag"] == "start"
    boards = [it["board"] for it in load_eval_items(cfg.data, cfg.algo.name, cfg.env.environment())]
    assert len(boards) == n
    expected = _expected(boards)
    assert row["eval/valid_call_rate"] == pytest.approx(1.0)
    assert row["eval/legal_move_rate"] == pytest.approx(expected["legal_move_rate"])
    # the rates by kind of board, the same function as `rlsys eval`'s (checked against the boards there)
    from rlsys.envs.tictactoe import game
    from rlsys.envs.tictactoe.reward import summarize_by_kind

    by_kind = summarize_by_kind([{"board": b} for b in boards], [game.move_outcome(b, FIXED_SQUARE) for b in boards])
    for key, value in by_kind.items():
        assert row[f"eval/{key}"] == pytest.approx(value), key
    for variant in PERTURBATIONS:
        rate = row[f"eval/{variant}/valid_call_rate"]
        assert 0.0 <= row[f"eval/{variant}/legal_move_rate"] <= rate <= 1.0, variant
        assert sum(row[f"eval/{variant}/{kind}_episodes"] for kind in game.BOARD_KINDS) == n, variant
