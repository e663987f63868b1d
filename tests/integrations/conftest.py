"""The integration tests run real jobs with the real frameworks (the ``lightning`` and
``transformers`` extras, which the ``dev`` extra installs). Without a framework its tests skip, except
under CI=true, where they must run."""
import importlib.util
import os

import pytest

from tests.launch.conftest import hg, node_home  # noqa: F401  (the launch tests' fixtures: real jobs, no leftovers)


def require(module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed: pip install -e '.[dev]' (the lightning and transformers extras)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)
