"""`rlsys play` in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium).

What is tested, honestly:
- against minimax (deterministic): clicking squares plays O, X answers with legal moves, the labels of
  the free squares and of the human's move are shown, and the game ends in a draw or an X win;
- against a real checkpoint through the agent path (openai client -> proxy -> engine -> tool-call parser ->
  reward): the tiny model overfit to always answer `choose_square(5)` (fixture from test_eval.py). Its
  first move (5 on the empty board) is a legal tool call whose raw text, outcome and reward the page shows;
  its second answer (5 again, now occupied) must appear as an error while the game goes on;
- the untrained tiny model (which makes no tool call): the page shows "no tool call" and the game goes on.
It is not a test of play strength. Pure helpers (labels, fallback, request errors) are tested without a
browser. The browser tests skip, saying why, when chromium, chromedriver or selenium is missing.

Set RLSYS_PLAY_SCREENSHOT=path.png to also write the page screenshot there (docs/img/play.png is made so).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.loop.conftest import REPO
from tests.loop.test_eval import FIXED_SQUARE, session_fixed_model

pytestmark = pytest.mark.timeout(300)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def browser_skip_reason() -> str | None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        return ("needs Chromium and ChromeDriver: apt-get install -y chromium chromium-driver "
                f"(chromium: {CHROMIUM or 'missing'}, chromedriver: {CHROMEDRIVER or 'missing'})")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium: pip install -e '.[test]'"
    return None


needs_browser = pytest.mark.skipif(browser_skip_reason() is not None, reason=browser_skip_reason() or "")


# --- pure helpers ---------------------------------------------------------------------------------
def test_human_move_labels_and_refusals():
    from jobs.play import MoveError, apply_human_move, game_status, square_labels

    board, info = apply_human_move("X........", 5)
    assert board == "X...O...." and info == {"square": 5, "label": "optimal", "score": 0.8}
    assert game_status(board) == "model_turn"
    labels = square_labels("X...O...X")  # O to move: every free square labelled from O's side
    assert set(labels) == {"2", "3", "4", "6", "7", "8"}
    assert all(v["label"] in ("win", "optimal", "legal_suboptimal") for v in labels.values())
    for bad_board, square, match in [("X........", 1, "occupied"), ("X........", 10, "integer 1..9"),
                                     ("XO.......", 3, "not O's turn"), ("XXXOO....", 6, "not O's turn"),
                                     ("XX", 1, "length"), ("X........", True, "integer 1..9")]:
        with pytest.raises(MoveError, match=match):
            apply_human_move(bad_board, square)


def test_x_turn_plays_a_random_legal_square_when_the_model_has_no_usable_move():
    from jobs.play import describe_error, fallback_square, minimax_square

    assert describe_error("no_tool_call", None, []).startswith("no tool call")
    assert describe_error("parse_error", None, ["bad JSON"]) == "parse error: the tool call could not be used: bad JSON"
    assert describe_error("occupied", 5, []) == "illegal move: square 5 is occupied"
    assert describe_error("optimal", 5, []) is None
    board = "XO..X...O"
    assert fallback_square(board) in (3, 4, 6, 7, 8) and fallback_square(board) == fallback_square(board)
    assert minimax_square("XX.OO....") == 3  # the immediate win


def test_minimax_only_app_serves_the_page_and_plays_without_a_model():
    from fastapi.testclient import TestClient

    from jobs.play import create_play_app

    client = TestClient(create_play_app(None, {"ckpt": "minimax", "model_path": None, "temperature": 0.0}))
    assert "<title>rlsys play" in client.get("/").text
    assert client.get("/api/info").json()["opponents"] == ["minimax"]
    assert client.post("/api/new", json={"opponent": "model"}).status_code == 400
    s = client.post("/api/new", json={"opponent": "minimax"}).json()
    assert s["board"].count("X") == 1 and s["status"] == "your_turn" and s["model"]["outcome"] == "optimal"
    assert len(s["hints"]) == 8
    free = s["board"].index(".") + 1
    s = client.post("/api/move", json={"board": s["board"], "square": free, "opponent": "minimax"}).json()
    assert s["human"]["square"] == free and s["board"].count("X") == 2 and s["board"][free - 1] == "O"


# --- a play server and a browser ------------------------------------------------------------------
class PlayServer:
    """`python -m jobs.play --port 0` in a subprocess; ``url`` once it prints that it listens."""

    def __init__(self, *args: str, timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.play", "--port", "0", *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout_s
        self.log: list[str] = []
        self.url = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            if "open http://127.0.0.1:" in line:
                self.url = line.split("open ", 1)[1].split()[0]
                return
        self.stop()
        raise RuntimeError("rlsys play did not start:\n" + "".join(self.log))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def fixed_model(tmp_path_factory) -> Path:
    return session_fixed_model(tmp_path_factory)


@pytest.fixture(scope="module")
def fixed_server(fixed_model):
    server = PlayServer("--ckpt", str(fixed_model))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    reason = browser_skip_reason()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-proxy-server", "--window-size=1080,760", f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def wait_idle(driver, timeout_s: float = 90.0) -> str:
    """Wait until the page is not waiting for X; returns the game status (body[data-status]). Status and busy flag
    are read in one script: read one call apart, a response landing between them paired the status of before it
    ("your_turn") with the busy flag of after it (a game X had just won, seen as O's turn with no hints)."""
    from selenium.webdriver.support.ui import WebDriverWait

    def idle(d):
        status, busy = d.execute_script(
            "return [document.body.dataset.status, document.getElementById('board').dataset.busy];")
        return status if busy == "false" and status not in ("loading", "model_turn") else False

    return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(idle)


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def board_of(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, "board").get_attribute("data-board")


def choose_opponent(driver, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "opponent")).select_by_value(value)  # starts a new game


def click_square(driver, square: int) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, f'#board .cell[data-square="{square}"]').click()


@needs_browser
def test_a_whole_game_against_minimax_by_clicking(browser, fixed_server):
    browser.get(fixed_server.url)
    wait_idle(browser)
    choose_opponent(browser, "minimax")
    status = wait_idle(browser)
    assert board_of(browser).count("X") == 1 and "Minimax played square" in text(browser, "model-move")
    while status == "your_turn":
        board = board_of(browser)
        hints = [el.text for el in browser.find_elements("css selector", "#board .cell .hint")]
        assert len(hints) == board.count(".") and all(h.split()[0] in ("win", "optimal", "legal_suboptimal")
                                                     for h in hints)
        square = board.index(".") + 1
        click_square(browser, square)
        status = wait_idle(browser)
        after = board_of(browser)
        assert after[square - 1] == "O", f"clicked {square}, board is {after}"
        assert f"You played square {square}:" in text(browser, "human-move")
        assert after.count("X") == after.count("O") + (0 if status == "o_wins" else 1), "X did not answer"
        assert text(browser, "model-error") == ""
    assert status in ("x_wins", "draw"), f"minimax lost? status {status}, board {board_of(browser)}"
    assert text(browser, "status") in ("X wins", "Draw")


@needs_browser
def test_the_checkpoint_moves_through_the_proxy_and_an_illegal_answer_is_shown(browser, fixed_server):
    browser.get(fixed_server.url)
    assert wait_idle(browser) == "your_turn"  # the model (X) opened
    assert board_of(browser) == "....X...."  # its tool call chose square 5: legal
    assert text(browser, "model-move") == f"Model played square {FIXED_SQUARE}"
    assert text(browser, "model-call") == f'choose_square({{"square": {FIXED_SQUARE}}})'
    assert text(browser, "model-outcome") == "optimal" and text(browser, "model-reward") == "0.8"
    raw = text(browser, "model-raw")
    assert raw.startswith("<tool_call>") and '"square": 5' in raw and raw.endswith("<|im_end|>")
    assert text(browser, "model-error") == ""

    click_square(browser, 1)
    status = wait_idle(browser)
    assert status == "your_turn"  # the game goes on
    board = board_of(browser)
    assert board[0] == "O" and board.count("X") == 2 and board.count("O") == 1
    assert text(browser, "model-outcome") == "occupied" and text(browser, "model-reward") == "-1.0"
    assert text(browser, "model-error") == f"illegal move: square {FIXED_SQUARE} is occupied"
    assert "was played for X at random so the game goes on" in text(browser, "model-move")
    assert "You played square 1: optimal (score 0.8 for O)" in text(browser, "human-move")
    shot = os.environ.get("RLSYS_PLAY_SCREENSHOT")
    png = browser.get_screenshot_as_png()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    if shot:
        Path(shot).write_bytes(png)


@needs_browser
def test_the_untrained_tiny_model_makes_no_tool_call_and_the_page_says_so(browser):
    server = PlayServer("--ckpt", "rlsys:tiny", "rollout.max_new_tokens=16")
    try:
        browser.get(server.url)
        assert wait_idle(browser) == "your_turn"
        assert text(browser, "model-outcome") in ("no_tool_call", "parse_error")
        assert text(browser, "model-reward") == "-1.0"
        assert text(browser, "model-error").startswith(("no tool call", "parse error"))
        assert text(browser, "model-call") == "none" or text(browser, "model-outcome") == "parse_error"
        assert text(browser, "model-raw") != ""
        free = board_of(browser).index(".") + 1
        click_square(browser, free)
        assert wait_idle(browser) in ("your_turn", "x_wins", "o_wins", "draw")
        assert board_of(browser)[free - 1] == "O"
    finally:
        server.stop()


def test_api_refuses_a_move_on_an_occupied_square(fixed_server):
    r = httpx.post(f"{fixed_server.url}api/move", json={"board": "....X....", "square": 5, "opponent": "minimax"},
                   trust_env=False, timeout=30)
    assert r.status_code == 400 and r.json() == {"error": "square 5 is occupied"}
    r = httpx.post(f"{fixed_server.url}api/move", json={"board": "....X....", "square": 1, "opponent": "gpt"},
                   trust_env=False, timeout=30)
    assert r.status_code == 400 and "opponent 'gpt'" in r.json()["error"]
