"""Running a plan's ranks as real local processes (hgcli.local) for the runtime tests."""
import sys
from pathlib import Path

import torch

from hgcli.local.run import LocalRunResult, run_plan

SCRIPTS = Path(__file__).parent / "scripts"


def script(name: str, *args: object) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *map(str, args)]


def run_ok(plan, argv, workdir: Path, **kw) -> LocalRunResult:
    result = run_plan(plan, argv, workdir=workdir, timeout_s=kw.pop("timeout_s", 240), **kw)
    if not result.ok:
        logs = "\n".join(f"--- rank {r.rank} ({r.role}) exit {r.exit_code}\n{r.output()[-2500:]}"
                         for r in result.ranks)
        raise AssertionError(f"job failed (timed out: {result.timed_out})\n{logs}")
    return result


def load(path: Path) -> torch.Tensor:
    return torch.load(path, weights_only=True)
