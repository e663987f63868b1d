"""A plain torchrun-style script (torch.distributed only, no hgcli): join through env://, record the
listening sockets ``ss`` shows on MASTER_PORT and of this process, all-reduce once, leave. Used by
test_launch_store.py."""
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
port = os.environ["MASTER_PORT"]
lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout.splitlines()
store = [line.split()[3] for line in lines if line.split()[3].rsplit(":", 1)[1] == port]
mine = [line.split()[3] for line in lines if f"pid={os.getpid()}," in line]
(out / f"store{rank}.txt").write_text("\n".join(store) + "\n")
(out / f"listen{rank}.txt").write_text("\n".join(mine) + "\n")
t = torch.ones(1)
dist.all_reduce(t)
(out / f"sum{rank}.txt").write_text(str(int(t.item())))
dist.destroy_process_group()
