"""Fault-injection tests reuse the launch tests' runner (``hg``: the real CLI in a subprocess, with
its own HOME and state directory, and a check that no process of its jobs is left afterwards)."""
from tests.launch.conftest import hg, hosts, node_home  # noqa: F401  (fixtures)
