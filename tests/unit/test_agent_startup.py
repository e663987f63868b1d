"""Every launch waits on the node agent's start-up (docs/launch.md, Performance): the agent as a
launch runs it (no arguments, ``python -S``) imports neither the schema classes nor argparse."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loaded_after(code: str) -> dict:
    probe = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}; import json; "
             "print(json.dumps({m: m in sys.modules for m in ('hgcli.schema.stages', 'argparse', 'hgcli.schema.codec')}))")
    out = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_agent_loads_only_what_a_launch_needs():
    assert loaded_after("import hgcli.node.agent.main") == {"hgcli.schema.stages": False, "argparse": False,
                                                       "hgcli.schema.codec": True}


def test_its_control_modes_still_parse_arguments():
    loaded = loaded_after("import hgcli.node.agent.main as a; a.parser()")
    assert loaded["argparse"]
