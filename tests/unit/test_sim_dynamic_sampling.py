"""scripts/sim_dynamic_sampling.py: the sieve on simulated steps gives the counts its extremes must."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sim_dynamic_sampling", REPO / "scripts/sim_dynamic_sampling.py")
sim = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sim  # its dataclass looks its module up there
spec.loader.exec_module(sim)


def test_every_board_with_signal_fills_the_batch_in_one_round_of_want_boards():
    r = sim.simulate(1.0, 8.0, 3, steps=50)
    assert r == {"kept": 4.0, "short": 0.0, "boards": 4.0, "answers": 32.0, "rounds": 1.0}


def test_no_signal_uses_every_round_at_the_cap_and_keeps_nothing():
    r = sim.simulate(0.0, 8.0, 3, steps=50)
    # first round: 4 groups at the cap of 8 boards each; the top-ups too (no keep rate to go by)
    assert (r["kept"], r["short"], r["rounds"], r["boards"]) == (0.0, 1.0, 3.0, 96.0)


def test_a_larger_cap_fills_more_steps_at_a_low_signal_rate(capsys):
    small, large = sim.simulate(0.05, 8.0, 3, steps=400), sim.simulate(0.05, 16.0, 3, steps=400)
    assert large["kept"] > small["kept"] and large["short"] < small["short"] and large["boards"] > small["boards"]
    assert sim.main(["--p", "0.05", "--caps", "8:3", "--steps", "50"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("| 0.05 | 8 | 3 |")
