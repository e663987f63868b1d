"""Two plain gloo ranks through hgcli.runtime.ps.transfer with a tiny CHUNK: rank 0 sends an fp32 and a
bf16 tensor of several chunks, rank 1 receives the first straight and widens the second into fp32.

    python transfer_pair.py RANK PORT OUT
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hgcli.runtime.ps import transfer

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
transfer.CHUNK = 5                  # 23 elements: five messages, the last one short
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
pair = dist.new_group([0, 1])
values = torch.arange(23, dtype=torch.float32) * 1.5 + 1 / 3
if rank == 0:
    works = transfer.send(values, 1, pair) + transfer.send(values.to(torch.bfloat16), 1, pair)
    transfer.wait(works)
else:
    straight, widened = torch.zeros(23), torch.zeros(23)
    transfer.recv(straight, 0, pair, torch.float32)
    transfer.recv(widened, 0, pair, torch.bfloat16, transfer.scratch(torch.bfloat16))
    torch.save({"straight": straight, "widened": widened, "expected": values}, out)
dist.destroy_process_group()
