"""What a synchronous step of a node's emulated ranks costs them: the all-reduce (waits included)
and the extra CPU their own compute takes as members of a synchronous group. The planner prices a
group made of a node's emulated devices with both (hgcli/plan/cost.py).

Emulated devices share the node's CPU and exchange over loopback gloo. What their all-reduce costs in
training is not what a link benchmark between two hot processes says: every step, each rank computes
(a share ``speed`` of the step on the CPU), sleeps out the rest of its emulated step and then joins
the all-reduce, so the ring starts with processes waking from a sleep on oversubscribed cores, and
the ranks leave it at different times (the last chunk reaches them one by one), which makes them
arrive unevenly at the next step's all-reduce: measured, this costs several times what the ring
formula on the two-rank link's figures predicts (benchmarks/RESULTS.md has the figures).

The ranks' own compute changes too: on a CPU shared by emulated ranks, the members of a synchronous
group can spend more CPU per step on the same forward and backward than the same devices running free
(the asynchronous PS strategy); the emulator stretches that CPU x 1/speed. Its mechanism is not
known, so it is measured rather than modelled (docs/bench.md, the group bench).

So both are measured the way training runs: ``ranks`` child processes (``--serve``), one gloo group
over loopback, each running the benched model's real step at ``batch`` through the runtime's
emulator at ``speed`` (forward + backward on one thread, the emulator's pause, the optimizer), in
alternating blocks of ``BLOCK`` steps: **free** (no collective; the ranks start each free block
spread over the step, as independent workers drift apart) and **synchronous** (the runtime's
all-reduce buffer after each step's pause: the model's parameters, the sample count and
MEMBER_SLOTS slots per rank, hgcli/runtime/group/engine.py). Alternating cancels the machine's drift, which over
seconds can be as large as the effect. Per pair of blocks:
- ``seconds``: rank 0's time inside the all-reduce per synchronous step (the mean of the block:
  throughput follows the mean, and single steps are skewed: the slowest take several times the
  median);
- ``compute_ratio``: the ranks' CPU per step in the synchronous block over the free block's.
The first step of every block is a transition and is not counted.

    python -m hgcli.node.bench.group --serve --rank R --ranks K --port P ...   (started by measure_group_sync)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from ...schema.stages import GroupSyncProfile
from .timing import summarize

KEY = "groupbench/blocks/"
BLOCK = 3   # counted steps per block (after one transition step)


def measure_group_sync(torch: Any, spec: str, parameters: int, *, ranks: int, batch: int, speed: float,
                       warmup: int, repeats: int, timeout_s: float = 60.0) -> GroupSyncProfile:
    """Run ``ranks`` children for ``warmup`` + ``repeats`` pairs of blocks (free, synchronous) of the
    model ``spec`` at ``batch`` and ``speed``; summarise the pairs after the warm-up."""
    import torch.distributed as dist

    from ...runtime.group.engine import sync_buffer_numel   # the runtime's own buffer (imports torch)
    from ...runtime.netbind import master_store

    store = master_store("127.0.0.1", 0, ranks + 1, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    argv = [sys.executable, "-m", "hgcli.node.bench.group", "--serve", "--ranks", str(ranks),
            "--port", str(store.port), "--model", spec, "--batch", str(batch), "--speed", repr(speed),
            "--pairs", str(warmup + repeats), "--timeout", repr(timeout_s)]
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
        blocks = [json.loads(store.get(f"{KEY}{r}").decode()) for r in range(ranks)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    added, ratios = summarize_pairs(blocks, warmup)
    step_s = statistics.median(p["free_step"] for p in blocks[0][warmup:])
    return GroupSyncProfile(ranks=ranks, bytes=4 * sync_buffer_numel(parameters, ranks), step_s=step_s,
                            seconds=summarize(added), batch=batch, speed=speed,
                            compute_ratio=summarize(ratios))


def summarize_pairs(blocks: list[list[dict[str, float]]], warmup: int) -> tuple[list[float], list[float]]:
    """Per pair of blocks after the warm-up: rank 0's all-reduce seconds per synchronous step, and
    the ranks' mean CPU per step synchronous over free. ``blocks[r]``: rank r's pairs, each
    ``{"free_cpu", "free_step", "sync_cpu", "sync_wait"}`` (seconds per step)."""
    added, ratios = [], []
    for k in range(warmup, len(blocks[0])):
        pair = [b[k] for b in blocks]
        added.append(pair[0]["sync_wait"])
        ratios.append(statistics.fmean(p["sync_cpu"] for p in pair) / statistics.fmean(p["free_cpu"] for p in pair))
    return added, ratios


def serve(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)    # like an emulated rank
    torch.manual_seed(args.rank)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", args.port, args.ranks + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("groupbench", store), rank=args.rank,
                            world_size=args.ranks, timeout=timeout)
    try:
        step, emulators, last_wall = _stepper(args)
        pairs = _pairs(args, step, emulators, last_wall)
        store.set(f"{KEY}{args.rank}", json.dumps(pairs))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _stepper(args: argparse.Namespace) -> tuple[Any, dict[bool, Any], Any]:
    """The model's training step as an emulated rank runs it, the emulator of each kind of block,
    and a reader of the last step's wall seconds outside the all-reduce."""
    import torch
    import torch.distributed as dist

    from ...runtime.emulate import Emulator
    from ...runtime.group.engine import MEMBER_SLOTS, sync_buffer_numel
    from .modelspec import load, parse_spec
    from .step import default_loss

    loaded = load(parse_spec(args.model))
    model = loaded.model
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = loaded.loss_fn or default_loss(torch)
    inputs, targets = loaded.make_batch(args.batch, torch.device("cpu"))
    tensors = (*(inputs if isinstance(inputs, tuple) else (inputs,)), targets)
    parameters = sum(p.numel() for p in model.parameters())
    buf = torch.zeros(sync_buffer_numel(parameters, args.ranks))
    slot = parameters + 1 + MEMBER_SLOTS * args.rank   # this rank's (batch, estimate, ...) in the buffer
    # One emulator per kind of block, so each block's pause follows its own steps' CPU: free
    # ranks stretch their own estimate, synchronous ones the members' pooled median, as the
    # runtime's singletons and groups do (hgcli/runtime/group/engine.py).
    emulators = {False: Emulator(args.speed), True: Emulator(args.speed)}
    step_wall = 0.0

    def step(n: int, synchronous: bool) -> float:
        """One training step as an emulated rank runs it; returns the seconds in the all-reduce."""
        nonlocal step_wall
        emulator = emulators[synchronous]
        start = time.perf_counter()
        emulator.begin_compute()
        order = torch.randperm(args.batch)     # the runtime gathers batches by a permutation
        *xb, yb = (t[order] if isinstance(t, torch.Tensor) and t.dim() else t for t in tensors)
        loss = loss_fn(model(*xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss.item()
        emulator.end_compute(n, args.batch)
        waited = 0.0
        if synchronous:
            buf.zero_()
            buf[slot], buf[slot + 1] = args.batch, emulator.estimate(args.batch)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            waited = time.perf_counter() - t0
            emulator.share(args.batch, statistics.median(buf[parameters + 2::2].tolist()))
        optimizer.step()
        step_wall = time.perf_counter() - start - waited
        return waited

    return step, emulators, lambda: step_wall


def _pairs(args: argparse.Namespace, step: Any, emulators: dict[bool, Any], last_wall: Any) -> list[dict[str, float]]:
    """``args.pairs`` pairs of blocks, free then synchronous: per step, CPU seconds and wall or wait."""
    pairs: list[dict[str, float]] = []
    n = 0
    for _ in range(args.pairs):
        pair: dict[str, float] = {}
        for synchronous in (False, True):
            if not synchronous:   # free workers are out of phase: spread the ranks over a step
                time.sleep(last_wall() * args.rank / args.ranks)
            step(n, synchronous)
            n += 1
            emulator = emulators[synchronous]
            cpu0, wall0, waited = emulator.compute_s, time.perf_counter(), 0.0
            for _ in range(BLOCK):
                waited += step(n, synchronous)
                n += 1
            cpu = (emulator.compute_s - cpu0) / BLOCK
            if synchronous:
                pair.update(sync_cpu=cpu, sync_wait=waited / BLOCK)
            else:
                pair.update(free_cpu=cpu, free_step=(time.perf_counter() - wall0) / BLOCK)
        pairs.append(pair)
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.bench.group")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True, help="the benched model spec (hgcli/node/bench/modelspec.py)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--speed", type=float, required=True, help="the emulated speed of every rank")
    p.add_argument("--pairs", type=int, required=True, help="pairs of blocks (free, synchronous)")
    p.add_argument("--timeout", type=float, default=60.0)
    serve(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
