"""Play tic-tac-toe against a checkpoint in the browser: `rlsys play --ckpt PATH [--port P]`.

You are O; the checkpoint is X and moves first, through the path training uses: the built-in tic-tac-toe
agent (`rlsys.envs.tictactoe.agent`) with an `openai.AsyncOpenAI` client against the rollout worker's
OpenAI-compatible proxy and engine (`actors.rollout.RolloutWorker`, here a plain object in this process,
no Ray), the session recorded by the proxy, scored by the training reward. The page shows what the
model sampled (the raw completion, special tokens included), its parsed tool call, the outcome label
and reward of its move, and for your side the label of every free square (win / optimal /
legal_suboptimal, from O's point of view) and of the move you made.

When the model makes no usable move (no tool call, a parse error, an occupied or off-board square),
the page says so, the move is scored as in training (-1.0), and a random legal square is played for X
so the game goes on. Opponent `minimax` replaces the model by the perfect player (for a sanity check,
or a game against something that does not lose).

The server listens on 127.0.0.1 only; the page is one HTML file with inline JS and CSS (jobs/static/),
no build step, nothing fetched from outside.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves endpoint annotations in module globals

from rlsys.envs.tictactoe import game

PAGE = Path(__file__).with_name("static") / "play.html"
HUMAN, MODEL = "O", "X"
LEGAL_OUTCOMES = ("legal_suboptimal", "optimal", "win")
OPPONENTS = ("model", "minimax")


class MoveError(ValueError):
    """A request the game cannot take (bad board, occupied square, game over); answered with a 400."""


# --- pure game helpers (tested without a model) ---------------------------------------------------
def game_status(board: str) -> str:
    """`x_wins`, `o_wins`, `draw`, or whose turn it is (`your_turn` for O, `model_turn` for X)."""
    win = game.winner(board)
    if win is not None:
        return f"{win.lower()}_wins"
    if game.EMPTY not in board:
        return "draw"
    return "your_turn" if game.to_move(board) == HUMAN else "model_turn"


def square_labels(board: str) -> dict[str, dict[str, Any]]:
    """Every free square's label and score for the side to move (O on the human's turn)."""
    if game.is_terminal(board):
        return {}
    return {str(sq): {"label": game.move_outcome(board, sq), "score": game.score_move(board, sq)}
            for sq in game.legal_moves(board)}


def check_board(board: Any) -> str:
    try:
        game.validate_board(board)
        game.to_move(board)
        game.winner(board)
    except (ValueError, TypeError) as err:
        raise MoveError(str(err)) from None
    return board


def apply_human_move(board: str, square: Any) -> tuple[str, dict[str, Any]]:
    """O's move on ``board``: the new board and what the move was worth (label and score for O)."""
    check_board(board)
    if game_status(board) != "your_turn":
        raise MoveError(f"board {board!r}: it is not O's turn ({game_status(board)})")
    if isinstance(square, bool) or not isinstance(square, int) or square not in game.SQUARES:
        raise MoveError(f"square must be an integer 1..9, got {square!r}")
    if board[square - 1] != game.EMPTY:
        raise MoveError(f"square {square} is occupied")
    info = {"square": square, "label": game.move_outcome(board, square), "score": game.score_move(board, square)}
    return game.apply_move(board, square, HUMAN), info


def minimax_square(board: str) -> int:
    """The perfect player's square: an immediate win if there is one, else the first minimax-best move."""
    best = game.best_moves(board)
    wins = [sq for sq in best if game.move_outcome(board, sq) == "win"]
    return (wins or best)[0]


def fallback_square(board: str) -> int:
    """The square played for X when the model made no usable move: random legal, seeded by the board."""
    return random.Random(board).choice(game.legal_moves(board))


def requested_square(output: Any) -> int | None:
    """The integer `square` of the first tool call in an agent output, if it has one."""
    try:
        args = json.loads(output["tool_calls"][0]["arguments"])
        square = args["square"]
    except (TypeError, KeyError, IndexError, ValueError):
        return None
    return square if type(square) is int else None


def describe_error(outcome: str, square: int | None, parse_errors: list[str]) -> str | None:
    """What the page shows in red when the model's move is not a legal one (None when it is)."""
    if outcome in LEGAL_OUTCOMES:
        return None
    if outcome == "no_tool_call":
        return "no tool call: the model answered without calling choose_square"
    if outcome == "parse_error":
        detail = f": {parse_errors[0]}" if parse_errors else " (not choose_square with one integer 'square')"
        return f"parse error: the tool call could not be used{detail}"
    if outcome == "occupied":
        return f"illegal move: square {square} is occupied"
    if outcome == "out_of_range":
        return f"illegal move: square {square} is not on the board (1..9)"
    return f"no usable move ({outcome})"


# --- the model side -------------------------------------------------------------------------------
class PlayBackend:
    """The engine + proxy (a RolloutWorker object in this process) and the agent/reward of training."""

    def __init__(self, cfg: Any, model_path: str, temperature: float = 0.0, agent_timeout_s: float = 120.0) -> None:
        from actors.rollout import RolloutWorker
        from jobs.placement import engine_settings

        self.cfg = cfg
        self.model_path = model_path
        self.temperature = temperature
        self.agent_timeout_s = agent_timeout_s
        self.worker = RolloutWorker(engine_settings(cfg, model_path), model_path,
                                    num_threads=max(1, os.cpu_count() or 1))
        self.info: dict[str, Any] = {}
        self._http = None

    async def start(self) -> None:
        import httpx

        self.info = await self.worker.start()
        await self.worker.set_temperature(self.temperature)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.agent_timeout_s), trust_env=False)

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        await self.worker.shutdown()

    async def model_move(self, board: str) -> dict[str, Any]:
        """One agent episode on ``board`` (X to move): the model's answer, scored as in training."""
        import openai

        from actors.env_worker import SESSION_HEADER
        from rlsys.envs.tictactoe import reward as ttt_reward
        from rlsys.envs.tictactoe.agent import agent
        from rlsys.envs.tictactoe.dataset import make_item
        from rlsys.envs.tictactoe.prompt import TOOL_NAME
        from rlsys.proxy.toolcalls import parse_tool_calls

        item = make_item(board)
        session = f"play-{uuid.uuid4().hex}"
        client = openai.AsyncOpenAI(base_url=self.info["url"], api_key=self.info["token"], max_retries=0,
                                    http_client=self._http, default_headers={SESSION_HEADER: session})
        output, agent_error = None, None
        try:
            output = await asyncio.wait_for(agent(item, client, self.info["model"]), self.agent_timeout_s)
        except Exception as err:  # shown on the page as the reason, like a failed trajectory in training
            agent_error = f"agent error: {type(err).__name__}: {err}"
        record = await self.worker.pop_session(session)
        sampled = [t for seg in record.segments for t, m in zip(seg.input_ids, seg.loss_mask) if m]
        raw = self.worker.tokenizer.decode(sampled, skip_special_tokens=False)
        parsed = parse_tool_calls(raw, tool_names={TOOL_NAME})
        rec = {"item": item, "output": output}
        outcome, reward = ttt_reward.outcome(rec), ttt_reward.reward(rec)
        square = requested_square(output)
        return {
            "opponent": "model", "raw_text": raw, "num_tokens": len(sampled),
            "content": (output or {}).get("content"), "tool_calls": (output or {}).get("tool_calls", []),
            "finish_reason": (output or {}).get("finish_reason"), "requested_square": square,
            "outcome": outcome, "reward": reward,
            "error": agent_error or describe_error(outcome, square, [e.message for e in parsed.errors]),
        }


def minimax_move(board: str) -> dict[str, Any]:
    square = minimax_square(board)
    arguments = json.dumps({"square": square})
    return {"opponent": "minimax", "raw_text": f"(minimax, no model) choose_square({arguments})", "num_tokens": 0,
            "content": None, "tool_calls": [{"name": "choose_square", "arguments": arguments}],
            "finish_reason": "tool_calls", "requested_square": square,
            "outcome": game.move_outcome(board, square), "reward": game.score_move(board, square), "error": None}


async def x_turn(backend: PlayBackend | None, board: str, opponent: str) -> tuple[str, dict[str, Any]]:
    """X's move on ``board``: the model's (or minimax's), or the fallback square when it was not legal."""
    if opponent == "minimax" or backend is None:
        move = minimax_move(board)
    else:
        move = await backend.model_move(board)
    if move["outcome"] in LEGAL_OUTCOMES:
        move["played"], move["fallback"] = move["requested_square"], False
    else:
        move["played"], move["fallback"] = fallback_square(board), True
    return game.apply_move(board, move["played"], MODEL), move


def state(board: str, model: dict[str, Any] | None, human: dict[str, Any] | None) -> dict[str, Any]:
    status = game_status(board)
    return {"board": board, "status": status, "model": model, "human": human,
            "hints": square_labels(board) if status == "your_turn" else {}}


# --- the web app ----------------------------------------------------------------------------------
def create_play_app(backend: PlayBackend | None, description: dict[str, Any]):
    """The page and its JSON API. ``backend`` None = minimax only (no model loaded)."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    lock = asyncio.Lock()  # one engine: moves are answered one at a time

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return PAGE.read_text(encoding="utf-8")

    @app.get("/api/info")
    async def info() -> dict[str, Any]:
        return {**description, "opponents": list(OPPONENTS) if backend is not None else ["minimax"]}

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise MoveError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise MoveError("the request body must be a JSON object")
        opponent = body.get("opponent", "model")
        if opponent not in OPPONENTS or (opponent == "model" and backend is None):
            raise MoveError(f"opponent {opponent!r}: expected one of {list(OPPONENTS) if backend else ['minimax']}")
        return body

    @app.exception_handler(MoveError)
    async def bad_move(request: Request, exc: MoveError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.post("/api/new")
    async def new_game(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        async with lock:
            board, move = await x_turn(backend, game.EMPTY * 9, body.get("opponent", "model"))
        return state(board, move, None)

    @app.post("/api/move")
    async def move(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        board, human = apply_human_move(check_board(body.get("board")), body.get("square"))
        model = None
        if game_status(board) == "model_turn":
            async with lock:
                board, model = await x_turn(backend, board, body.get("opponent", "model"))
        return state(board, model, human)

    return app


async def serve(backend: PlayBackend | None, description: dict[str, Any], port: int,
                ready: asyncio.Event | None = None) -> None:
    """Serve the page on 127.0.0.1:``port`` (0: a free port) until cancelled or interrupted."""
    from rlsys.proxy.server import ProxyServer

    if backend is not None:
        await backend.start()
    server = ProxyServer(create_play_app(backend, description), host="127.0.0.1", port=port)
    try:
        await server.start()
        print(f"rlsys play: open http://127.0.0.1:{server.port}/  (you are O; {description['ckpt']} is X)",
              flush=True)
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()  # until Ctrl-C / cancellation
    finally:
        await server.stop()
        if backend is not None:
            await backend.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlsys play", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", default="rlsys:tiny",
                   help="model folder, run directory (its latest checkpoint) or rlsys:tiny (default)")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765; 0 = any free port)")
    p.add_argument("--temperature", type=float, default=0.0, help="model sampling temperature (default 0: greedy)")
    p.add_argument("--minimax-only", action="store_true", help="load no model: play against minimax only")
    p.add_argument("--config", metavar="FILE.toml", help="config to start from (default: the checkpoint's own)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. rollout.engine=transformers")
    return p


def main(argv: list[str] | None = None) -> int:
    from jobs.eval import EvalRequest, eval_config
    from rlsys.errors import UserInputError
    from rlsys.models.resolve import resolve_model

    args = build_parser().parse_args(argv)
    backend, model_path = None, None
    try:
        if not args.minimax_only:
            cfg = eval_config(EvalRequest(ckpt=args.ckpt, config=args.config, overrides=list(args.overrides)))
            model_path = resolve_model(cfg.model.ckpt)
            backend = PlayBackend(cfg, model_path, temperature=args.temperature)
    except UserInputError as err:
        print(f"rlsys play: {err}", file=sys.stderr)
        return 2
    description = {"ckpt": args.ckpt if backend else "minimax", "model_path": model_path,
                   "temperature": args.temperature}
    try:
        asyncio.run(serve(backend, description, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
