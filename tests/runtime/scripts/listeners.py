"""Join the job (store, gloo, RPC when the plan has a PS), record this process's listening sockets as
``ss`` shows them, all-reduce once to prove the job works, leave. Used by test_netbind.py."""
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hgcli.runtime.env import RankEnv
from hgcli.runtime.groups import init_distributed, shutdown

out = Path(sys.argv[1])
env = RankEnv.from_environ()
init_distributed(env, env.plan)
lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
mine = [line.split()[3] for line in lines if f"pid={os.getpid()}," in line]
(out / f"listen{env.rank}.txt").write_text("\n".join(mine) + "\n")
dist.barrier()
t = torch.ones(1)
dist.all_reduce(t)
(out / f"sum{env.rank}.txt").write_text(str(int(t.item())))
shutdown(env.plan, env.timeout_s)
