"""Loop tests: the whole job on CPU under a real local Ray, real HTTP, the tiny model (fixtures in tests/conftest.py)."""
from tests.conftest import PLUGINS, REPO, job_config  # noqa: F401  (re-exported for the loop tests)
