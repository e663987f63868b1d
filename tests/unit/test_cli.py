"""The CLI shell: help, version, the light controller, unimplemented commands do not pretend."""
import subprocess
import sys

from hgcli import __version__
from hgcli.cli import main


def test_version(capsys):
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("probe", "bench", "plan", "launch", "status", "logs", "stop"):
        assert name in out


def test_help_does_not_import_torch():
    code = "import sys; from hgcli.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_unknown_flag_is_usage_error(capsys):
    assert main(["probe", "--nope"]) == 2
    assert "--nope" in capsys.readouterr().err
