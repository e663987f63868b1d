"""What a synchronous step of a node's emulated ranks adds to their compute: the planner's all-reduce
of a group made of every emulated device of one node.

Emulated devices share the node's CPU and exchange over loopback gloo. What their all-reduce costs in
training is not what a link benchmark between two hot processes says: every step, each rank computes
(a share ``speed`` of the step on the CPU), sleeps out the rest of its emulated step and then joins
the all-reduce, so the ring starts with processes waking from a sleep on oversubscribed cores, and
the ranks leave it at different times (the last chunk reaches them one by one), which makes them
arrive unevenly at the next step's all-reduce. On the 2-core development machine that came to
8-10 ms per step for four ranks and a 0.7 MB model, where the ring formula on the two-rank link's
figures gave 2.5 ms and the straggle term 1.7 (docs/planning.md). So it is measured the way
training runs it: ``ranks`` child processes (``--serve``), one gloo group over loopback, each
looping: spin ``cpu_s`` of CPU, sleep until ``step_s`` after its previous all-reduce ended,
all-reduce the runtime's buffer (the model's parameters, the sample count and two slots per rank,
hgcli/runtime/hybrid.py). The figure is the period of that loop minus ``step_s``: what the
synchronous step adds, waits included; each repeat is the mean over ``BLOCK`` steps, because
throughput follows the mean and single steps are skewed (median 6 ms, the slowest 13-19 ms, in
the same 20 steps).

    python -m hgcli.node.groupbench --serve --rank R --ranks K --port P ...   (started by measure_group_sync)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

from ..model import GroupSyncProfile
from .timing import summarize

KEY = "groupbench/periods/"
BLOCK = 3   # steps per repeat


def measure_group_sync(torch: Any, parameters: int, *, ranks: int, step_s: float, cpu_s: float,
                       warmup: int, repeats: int, timeout_s: float = 60.0) -> GroupSyncProfile:
    """Run ``ranks`` looping children and summarise rank 0's loop periods minus ``step_s``."""
    import torch.distributed as dist

    from ..runtime.hybrid import sync_buffer_numel   # the runtime's own buffer (imports torch)

    store = dist.TCPStore("127.0.0.1", 0, ranks + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    argv = [sys.executable, "-m", "hgcli.node.groupbench", "--serve", "--ranks", str(ranks),
            "--port", str(store.port), "--parameters", str(parameters), "--step", repr(step_s),
            "--cpu", repr(cpu_s), "--iterations", str(warmup + BLOCK * repeats), "--timeout", repr(timeout_s)]
    children = [subprocess.Popen([*argv, "--rank", str(r)], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
                for r in range(ranks)]
    deadline = time.monotonic() + timeout_s
    try:
        for child in children:
            _, err = child.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if child.returncode:
                lines = err.decode(errors="replace").strip().splitlines()
                raise RuntimeError(f"a group benchmark rank exited {child.returncode}: "
                                   f"{lines[-1] if lines else 'no output'}")
        periods = json.loads(store.get(f"{KEY}0").decode())
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    timed = periods[warmup:]
    added = [max(0.0, sum(timed[k:k + BLOCK]) / BLOCK - step_s) for k in range(0, len(timed) - BLOCK + 1, BLOCK)]
    return GroupSyncProfile(ranks=ranks, bytes=4 * sync_buffer_numel(parameters, ranks), step_s=step_s,
                            seconds=summarize(added))


def serve(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ..runtime.hybrid import sync_buffer_numel

    torch.set_num_threads(1)    # like an emulated rank
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.port, args.ranks + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("groupbench", store), rank=args.rank,
                            world_size=args.ranks, timeout=timeout)
    try:
        buf = torch.zeros(sync_buffer_numel(args.parameters, args.ranks))
        ends, last = [], time.perf_counter()
        for _ in range(args.iterations + 1):
            cpu_end = time.thread_time() + args.cpu
            while time.thread_time() < cpu_end:     # the rank's own share of its emulated step
                pass
            time.sleep(max(0.0, last + args.step - time.perf_counter()))
            dist.all_reduce(buf)
            last = time.perf_counter()
            ends.append(last)
        if args.rank == 0:
            store.set(f"{KEY}0", json.dumps([b - a for a, b in zip(ends, ends[1:])]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.groupbench")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parameters", type=int, required=True)
    p.add_argument("--step", type=float, required=True, help="seconds of an emulated step")
    p.add_argument("--cpu", type=float, required=True, help="CPU seconds of it spent computing")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    serve(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
