"""The torchrun baseline of benchmarks/pipeline_e2e.py: plain DistributedDataParallel on the bundled
example's model and data, each rank emulated at its own speed the way hgcli.runtime emulates.

    E2E_SPEEDS=0.1,0.1,0.025,0.025 E2E_BATCHES=64,64,64,64 E2E_METRICS=/tmp/m \\
        python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/ddp_emulated.py --epochs 2

Takes the flags of ``hgcli.examples.train_mlp`` (same model, optimizer, data order, evaluation), so the
benchmark passes both scripts one argument list. Environment:
- ``E2E_SPEEDS``: emulated speed of every rank, comma-separated, indexed by RANK;
- ``E2E_BATCHES``: every rank's batch (one global batch per step, cut as ``ctx.shard`` cuts it, so
  every rank makes the same number of steps, as DDP needs);
- ``E2E_METRICS``: a directory; rank R writes ``rank<R>.jsonl``, records shaped like ``ctx.log``'s
  (``time``, ``rank``, ``step``, ``samples``, ``loss``; ``event`` eval / finish / final);
- ``HGTRAIN_EMULATE_STRAGGLER`` / ``HGTRAIN_EMULATE_SEED``: the runtime's dynamic stragglers, same
  rule (hgcli/runtime/emulate.py ``is_straggler``), so both sides see the same slowed steps.

Emulation as in hgcli/runtime/hybrid.py: a step's compute (batch gather, forward, backward) ends
where the gradient exchange starts, which under DDP is the comm hook of the step's first bucket;
the emulator sleeps there, then the step's all-reduce (``hg.weighted_ddp_hook``: the union-batch
mean gradient, as the runtime's weighted all-reduce gives) and the optimizer run unstretched, and
the next step's compute starts after ``opt.step()``. The ranks pool their stable CPU estimates for
equal batches (``Emulator.share``) as the runtime's group members on one node do, so the baseline
does not wait for an artefact of emulating on one shared CPU that the runtime has removed; this
costs one small extra all-reduce per step that the runtime folds into its gradient's.
"""
# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects (hgcli/runtime/ddp.py).
import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from hgcli.examples.data import accuracy, make_dataset, make_model
from hgcli.runtime import WeightedDDPState, weighted_ddp_hook
from hgcli.runtime.data import shard_batches
from hgcli.runtime.emulate import Emulator


class Recorder:
    """Metric records like ctx.log's, one JSON object per line in this rank's file."""

    def __init__(self, directory: str, rank: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.fh: TextIO = open(Path(directory) / f"rank{rank}.jsonl", "w", encoding="utf-8")

    def log(self, **fields: Any) -> None:
        self.fh.write(json.dumps({"time": time.time(), "rank": self.rank, "group": 0, **fields}) + "\n")

    def close(self) -> None:
        self.fh.close()


class EmulatedStep:
    """DDP comm hook state: the emulator's end of compute at the step's first bucket, the pooled
    estimates, then the weighted all-reduce."""

    def __init__(self, emulator: Emulator, batch: int, world: int, rank: int) -> None:
        self.emulator, self.batch, self.world, self.rank = emulator, batch, world, rank
        self.weights = WeightedDDPState(batch_size=batch)
        self.step = 0
        self.pending = True      # the next bucket is the step's first

    def begin(self) -> None:
        self.pending = True
        self.emulator.begin_compute()

    def first_bucket(self) -> None:
        self.pending = False
        self.emulator.end_compute(self.step, self.batch)
        slots = torch.zeros(2 * self.world, dtype=torch.float64)
        slots[2 * self.rank] = self.batch
        slots[2 * self.rank + 1] = self.emulator.estimate(self.batch)
        dist.all_reduce(slots)
        pairs = slots.view(-1, 2).tolist()
        pool = [est for b, est in pairs if b == self.batch and est > 0]
        if len(pool) > 1:
            self.emulator.share(self.batch, statistics.median(pool))
        self.step += 1


def emulated_hook(state: EmulatedStep, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if state.pending:
        state.first_bucket()
    return weighted_ddp_hook(state.weights, bucket)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="unused: E2E_BATCHES gives every rank's batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-samples", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--target", type=float, default=0.92)
    p.add_argument("--max-steps", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)     # emulated devices share one CPU, as under the runtime
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    speeds = [float(s) for s in os.environ["E2E_SPEEDS"].split(",")]
    batches = [int(b) for b in os.environ["E2E_BATCHES"].split(",")]
    if len(speeds) != world or len(batches) != world:
        raise SystemExit(f"E2E_SPEEDS and E2E_BATCHES need {world} entries each")
    rec = Recorder(os.environ["E2E_METRICS"], rank)
    emulator = Emulator(speeds[rank], worker_index=rank, n_workers=world,
                        straggler_factor=float(os.environ.get("HGTRAIN_EMULATE_STRAGGLER") or 1),
                        straggler_seed=int(os.environ.get("HGTRAIN_EMULATE_SEED") or 0))
    dist.init_process_group("gloo")
    (x, y), (xt, yt) = make_dataset()
    model = DistributedDataParallel(make_model(hidden=args.hidden))
    state = EmulatedStep(emulator, batches[rank], world, rank)
    model.register_comm_hook(state, emulated_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start, reached, samples = time.time(), None, 0
    state.begin()
    for step, (xb, yb) in enumerate(shard_batches((x, y), batches, rank, epochs=args.epochs, seed=0)):
        if step == args.max_steps > 0:
            break
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()          # the hook ends the step's compute, sleeps, all-reduces
        opt.step()
        state.begin()
        samples += len(xb)
        if rank == 0 and step % args.eval_every == 0:
            with emulator.untimed():
                acc = accuracy(model.module, xt[:args.eval_samples], yt[:args.eval_samples])
                if reached is None and acc >= args.target:
                    reached = time.time() - start
                rec.log(event="eval", step=step, accuracy=acc, elapsed_s=time.time() - start)
        value = loss.item()      # in the next step's compute, as train.py's ctx.log(loss=loss.item())
        with emulator.untimed():
            rec.log(step=step, loss=value, samples=len(xb))
    rec.log(event="finish", samples=samples, steps=state.step, compute_s=emulator.compute_s,
            emulated_sleep_s=emulator.slept_s)
    dist.barrier()
    if rank == 0:
        acc = accuracy(model.module, xt, yt)
        rec.log(event="final", accuracy=acc, elapsed_s=time.time() - start, target=args.target,
                time_to_target_s=reached)
        print(f"final test accuracy {acc:.4f} after {time.time() - start:.1f} s", flush=True)
    rec.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
