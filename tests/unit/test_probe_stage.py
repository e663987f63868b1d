"""The probe stage without SSH: parsing the node's answer, arguments, rendering, the CLI contract."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from hgcli.cli import main
from hgcli.errors import RemoteError
from hgcli.schema.stages import EmulateSpec, GpuInfo, Inventory, NodeInfo, NodeSpec, to_dict
from hgcli.node import frames
from hgcli.probe.inventory import parse_probe_output, probe_args
from hgcli.render.probe import render_inventory

NODE = NodeSpec(name="n1", host="gpu1")
INFO = NodeInfo(name="n1", host="gpu1", ok=True, gpus=(GpuInfo(index=0, name="Tesla T4", memory_total_mib=15360),))


def test_answer_found_among_login_noise():
    noise = "Last login: yesterday\n{\"type\": \"probe\"}\n\x1ehgtrain {broken\n"
    out = noise + frames.encode({"type": "probe", "node": to_dict(INFO)}) + "bye\n"
    assert parse_probe_output(NODE, 0, out, "rc warning\n") == INFO


def test_no_answer_names_exit_code_and_last_stderr_line():
    with pytest.raises(RemoteError, match=r"no answer \(exit code 1\): ModuleNotFoundError: x") as info:
        parse_probe_output(NODE, 1, "motd\n", "Traceback...\nModuleNotFoundError: x\n")
    assert info.value.host == "n1"


def test_answer_of_wrong_shape_is_an_error():
    out = frames.encode({"type": "probe", "node": {"name": "n1"}})
    with pytest.raises(RemoteError, match="cannot read"):
        parse_probe_output(NODE, 0, out, "")


def test_probe_args_pass_gpus_and_emulation():
    emulate = EmulateSpec(devices=("Tesla T4",), speed=(0.5,), memory_mib=(15360,))
    args = probe_args(NodeSpec(name="n", host="h", gpus=(0, 2), emulate=emulate))
    assert args[:4] == ["--name", "n", "--host", "h"]
    assert args[args.index("--gpus") + 1] == "0,2"
    assert json.loads(args[args.index("--emulate") + 1]) == to_dict(emulate)
    assert "--gpus" not in probe_args(NODE) and "--emulate" not in probe_args(NODE)


def test_table_marks_emulated_devices_and_failed_nodes():
    inventory = Inventory(cluster="x", nodes=(
        NodeInfo(name="emu", host="localhost", ok=True, emulated=True,
                 gpus=(GpuInfo(index=0, name="Tesla T4", memory_total_mib=15360, emulated=True, speed=0.25),)),
        NodeInfo(name="cpu", host="c1", ok=True),
        NodeInfo(name="bad", host="b1", ok=False, error="connection refused by b1:22"),
    ))
    console = Console(record=True, width=160)
    render_inventory(inventory, console)
    text = console.export_text()
    assert "EMULATED x0.25" in text and "CPU only" in text
    assert "bad (b1) FAILED: connection refused by b1:22" in text
    assert "2/3 node(s) answered; failed: bad" in text


def test_a_failed_nodes_whole_reason_is_shown_folded_on_a_narrow_non_terminal():
    """Piped (no terminal: 80 columns), the reason was cut in its table cell with '…': the host key's
    fingerprint and the ssh-keyscan line that fixes it were lost."""
    import io

    reason = ("host key of 127.0.0.5 is unknown (SHA256:Qm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5d2FsZG8x): "
              "refused (strict_host_key_checking = yes); if this is the right host, add it: "
              "ssh-keyscan -p 2222 127.0.0.5 >> /root/.ssh/known_hosts")
    inventory = Inventory(cluster="x", nodes=(
        NodeInfo(name="gpu-node-with-a-long-name", host="127.0.0.5", ok=False, error=reason),
        NodeInfo(name="cpu", host="c1", ok=True)))
    out = io.StringIO()
    render_inventory(inventory, Console(file=out, width=60))
    text = out.getvalue()
    assert "…" not in text, text
    assert "add it: ssh-keyscan -p 2222 127.0.0.5 >> /root/.ssh/known_hosts" in " ".join(text.split()), text
    assert "SHA256:Qm9vYmFyYmF6cXV4cXV1eGNvcmdlZ3JhdWx0Z2FycGx5d2FsZG8x" in text.replace("\n", ""), text


def test_cli_probe_local_json_only_and_light():
    # The embedded local cluster: JSON only on stdout, exit 0, and neither torch nor paramiko
    # imported by the controller (no SSH node, and probe must stay light).
    code = ("import sys; from hgcli.cli import main; rc = main(['probe', '--json']);"
            "print('MODULES', 'torch' in sys.modules, 'paramiko' in sys.modules, rc, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    data = json.loads(proc.stdout)
    assert [n["name"] for n in data["nodes"]] == ["local"] and data["nodes"][0]["ok"]
    assert "MODULES False False 0" in proc.stderr


def test_cli_probe_bad_cluster_file_is_usage_error(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("[[nodes]]\nname = 'x'\n")
    assert main(["probe", "-c", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


def test_progress_only_on_a_terminal():
    import io

    from hgcli.render.probe import probe_progress

    with probe_progress(["a"], Console(file=io.StringIO())) as on_done:
        assert on_done is None
    out = io.StringIO()
    with probe_progress(["a", "b"], Console(file=out, force_terminal=True, width=100)) as on_done:
        on_done(NodeInfo(name="a", host="h", ok=True, elapsed_s=0.5))
        on_done(NodeInfo(name="b", host="h", ok=False, error="authentication failed", elapsed_s=1.0))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())   # without the colour codes
    assert "ok   a (0.5 s)" in text and "FAIL b (1.0 s): authentication failed" in text
