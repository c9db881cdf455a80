"""The README's two set-up commands stay true: CI runs the test command verbatim, the main job's config exists."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    main_job, tests = (b.strip() for b in _bash_blocks()[:2])
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_main_job_command_names_files_that_exist():
    main_job = _bash_blocks()[0]
    assert re.search(r"rlsys (train|recipe) --config", main_job), main_job
    for path in re.findall(r"(configs/\S+\.toml|scripts/\S+\.sh)", main_job):
        assert (ROOT / path).is_file(), path
    if "rlsys recipe" in main_job:  # every stage's config file resolves and validates
        from jobs.recipe import read_recipe

        (path,) = re.findall(r"configs/\S+\.toml", main_job)
        assert read_recipe(ROOT / path).stages
