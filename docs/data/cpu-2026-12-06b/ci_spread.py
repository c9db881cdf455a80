"""EXTRA="gspo:key=value ..." python ci_spread.py OUT.jsonl SEED:BOARD_SEED ...

The CI learning test's run (tests/loop/test_learning.py) for several recipe/board seeds; one JSON line per run.
The overlapped runs of 2026-12-06 ran before the test pinned its rollout in turn: to repeat them now,
EXTRA="gspo:rollout.overlap=true" (and gspo:algo.logp_mode=\"decoupled\" for the second table row); later overrides win."""
import json, os, sys, time
from pathlib import Path
import tempfile
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root: run from anywhere
os.environ.setdefault("RAY_AUTH_MODE", "token")
import ray
from tests.loop.test_learning import centre_free_boards, shortened
from tests.conftest import REPO
from jobs.recipe import read_recipe, run_recipe

ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}})
out = Path(sys.argv[1])
extra = os.environ.get("EXTRA", "").split()
for pair in sys.argv[2:]:
    seed, board_seed = map(int, pair.split(":"))
    tmp = Path(tempfile.mkdtemp(prefix=f"ci-spread-{seed}-{board_seed}-"))
    recipe = read_recipe(REPO / "configs" / "recipes" / "tictactoe-tiny.toml")
    recipe.seed = seed
    t0 = time.time()
    s = run_recipe(recipe, tmp / "run", shortened(*centre_free_boards(tmp, seed=board_seed)) + extra, window=10)
    row = {"seed": seed, "board_seed": board_seed, "legal": s["held_out"]["legal_move_rate"],
           "optimal": s["held_out"]["optimal_move_rate"], "reward": s["curve"]["rewards_mean"],
           "wall_s": round(time.time() - t0, 1), "extra": extra}
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(row, flush=True)
