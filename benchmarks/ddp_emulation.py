"""What the torchrun baselines of benchmarks/pipeline_e2e.py share: a DDP rank emulated at its own
speed the way hgcli.runtime emulates, its batch from the benchmark, its metrics like ``ctx.log``'s.

The twins (``ddp_emulated.py`` for ``hgcli.examples.train_mlp``, ``ddp_resnet_emulated.py`` for
``hgcli.examples.train``) keep their script's training loop and call ``join()`` for everything
else, so the two baselines emulate alike and differ from their scripts only in the aggregation.
Environment (set by pipeline_e2e.py; torchrun passes it to every rank):
- ``E2E_SPEEDS``: emulated speed of every rank, comma-separated, indexed by RANK;
- ``E2E_BATCHES``: every rank's batch (one global batch per step, cut as ``ctx.shard`` and
  ``ctx.sampler`` cut it, so every rank makes the same number of steps, as DDP needs);
- ``E2E_METRICS``: a directory; rank R writes ``rank<R>.jsonl``, records shaped like ``ctx.log``'s
  (``time``, ``rank``, ``step``, ``samples``, ``loss``; ``event`` eval / finish / final);
- ``HGTRAIN_EMULATE_STRAGGLER`` / ``HGTRAIN_EMULATE_SEED``: the runtime's dynamic stragglers, same
  rule (hgcli/runtime/emulate.py ``is_straggler``), so both sides see the same slowed steps;
- ``E2E_SLOWDOWN`` (optional): ``RANK:AFTER_SECONDS:FACTOR``, that rank's device divided by FACTOR
  from AFTER_SECONDS after it started, as a cluster file's ``emulate.slowdown`` does to the runtime's.

Emulation as in hgcli/runtime/group/engine.py: a step's compute (batch gather, forward, backward) ends
where the gradient exchange starts, which under DDP is the comm hook of the step's first bucket;
the emulator sleeps there, then the step's all-reduce (``hg.weighted_ddp_hook``: the union-batch
mean gradient, as the runtime's weighted all-reduce gives), any clipping and the optimizer run
unstretched, and the next step's compute starts when ``opt.step()`` returns (the optimizer's
step post-hook, where the runtime starts it too). The ranks pool their stable CPU estimates for
equal batches (``Emulator.share``) as the runtime's group members on one node do, so the baseline
does not wait for an artefact of emulating on one shared CPU that the runtime has removed; this
costs one small extra all-reduce per step that the runtime folds into its gradient's.
"""
# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects (hgcli/runtime/group/ddp.py).
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, TextIO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hgcli.runtime import WeightedDDPState, weighted_ddp_hook
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


@dataclass(frozen=True)
class Settings:
    """This rank's part of the benchmark's environment."""

    speed: float
    batches: list[int]           # every rank's, by RANK
    metrics: str
    straggler_factor: float
    straggler_seed: int
    slowdown: list[tuple[float, float]]      # this rank's (after seconds, factor)


def settings(env: Mapping[str, str], world: int) -> Settings:
    """Read and check the environment the benchmark sets (module docstring); one clear line if not."""
    try:
        speeds = [float(s) for s in env["E2E_SPEEDS"].split(",")]
        batches = [int(b) for b in env["E2E_BATCHES"].split(",")]
        metrics = env["E2E_METRICS"]
        factor = float(env.get("HGTRAIN_EMULATE_STRAGGLER") or 1)
        seed = int(env.get("HGTRAIN_EMULATE_SEED") or 0)
        rank = int(env["RANK"])
        slowdown = []
        if env.get("E2E_SLOWDOWN"):
            who, after, by = env["E2E_SLOWDOWN"].split(":")
            if int(who) == rank:
                slowdown.append((float(after), float(by)))
    except KeyError as exc:
        raise SystemExit(f"{exc.args[0]} is not set: run under benchmarks/pipeline_e2e.py "
                         f"(see benchmarks/ddp_emulation.py)") from None
    except ValueError as exc:
        raise SystemExit(f"E2E_SPEEDS / E2E_BATCHES / E2E_SLOWDOWN / HGTRAIN_EMULATE_*: {exc}") from None
    if len(speeds) != world or len(batches) != world:
        raise SystemExit(f"E2E_SPEEDS and E2E_BATCHES need {world} entries each (WORLD_SIZE), "
                         f"got {len(speeds)} and {len(batches)}")
    if min(speeds) <= 0 or min(batches) < 1:
        raise SystemExit(f"E2E_SPEEDS must be positive and E2E_BATCHES at least 1: {speeds}, {batches}")
    return Settings(speeds[rank], batches, metrics, factor, seed, slowdown)


class EmulatedRank:
    """One torchrun rank of a twin: its process group (gloo), batch, emulator and metrics."""

    def __init__(self) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        s = settings(os.environ, self.world)
        self.batches = s.batches
        self.batch = s.batches[self.rank]
        self.emulator = Emulator(s.speed, worker_index=self.rank, n_workers=self.world,
                                 straggler_factor=s.straggler_factor, straggler_seed=s.straggler_seed,
                                 slowdown=s.slowdown)
        self.recorder = Recorder(s.metrics, self.rank)
        self.state = EmulatedStep(self.emulator, self.batch, self.world, self.rank)
        dist.init_process_group("gloo")

    def attach(self, model: DistributedDataParallel, opt: torch.optim.Optimizer) -> None:
        """The comm hook ends each step's compute and all-reduces; ``opt.step()`` starts the next
        step's compute (from now on)."""
        model.register_comm_hook(self.state, emulated_hook)
        opt.register_step_post_hook(lambda *_: self.state.begin())
        self.state.begin()

    def log(self, **fields: Any) -> None:
        """``ctx.log``: a metric record, not stretched by the emulation."""
        with self.emulator.untimed():
            self.recorder.log(**fields)

    def finish(self, samples: int) -> None:
        """``ctx.finish``: this rank's totals, then every rank waits for the others."""
        self.log(event="finish", samples=samples, steps=self.state.step, compute_s=self.emulator.compute_s,
                 emulated_sleep_s=self.emulator.slept_s)
        dist.barrier()

    def close(self) -> None:
        self.recorder.close()
        dist.destroy_process_group()
