"""Time a node's devices the way they will train: all of them stepping at once; runs ON the node.

    python -m hgcli.node.bench.together --node NAME --model SPEC --job JSON [--lifeline]

Each device bench (main.py) runs alone, so it cannot see what the node's devices cost each other
when they train side by side: the CPU cores that emulated devices and the ranks' host threads share,
the caches, the memory and PCIe buses. This program starts one process per device (``--serve``), as
the launcher starts one rank per device, and has every process step the benched model through the
runtime's own step machinery (hgcli/runtime/group/engine.py with the device's emulator) over the same
windows of time, one window per phase. In each phase every device runs its own batch (the job gives
them: batches of about equal step time, as a plan splits a batch by speed), so the devices step
alongside each other for the whole window the way a job's ranks do. A step's wall time is what is
measured: on an emulated device the emulator's pause is in it, and so is every wait for a core.
A phase ends for every process at one instant, when each device has ``steps`` counted steps and
``least_s`` seconds have passed, or at ``most_s`` seconds: a window long enough for the slowest
device on a busy node, and no longer.

The job (JSON, from the controller, hgcli/bench/together.py):
``{"devices": [{"device": "gpu0", "speed": 1.0 | null, "batches": [16, 64]}, ...],
"steps": 8, "least_s": 1.5, "most_s": 8.0, "warmup": 2}``: ``speed`` null for a real device; one
batch per phase and device.

Frames on stdout: ``progress``, ``note`` (what was not measured, and why) and, when every process
finished, one ``together`` frame: ``{"node", "devices": {DEVICE: TogetherProfile as a dict}}``.
The exit code is 0 either way: the controller reads the frames.

A child (``--serve``) speaks plain lines on its own stdin/stdout with this parent: it prints
``ready`` once its model is loaded and warm at every batch, reads ``go T0`` (T0 on the monotonic
clock, which is the machine's and so every process's), steps from T0 printing ``step`` after each
step, moves to the next phase when it reads ``end T`` (the steps finished after T are not wholly
inside the window and are dropped), and after the last phase prints one JSON line: per phase, the
wall seconds of its steps.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Callable

from ...schema.stages import Measurement, TogetherProfile, TogetherStep, to_dict
from ..frames import emit
from ..protocol import FrameType
from .failure import first_line
from .lifeline import watch_stdin

# Before the common start, the slowest process imports torch and loads the model: generous, since
# the node may be busy. After it, the phases last what the job says.
READY_TIMEOUT_S = 240.0
# A phase's first step in each process is a transition (the neighbours may still finish a step of
# the previous phase): not counted.
SKIP_FIRST = 1
# How long after the last "ready" the common start is: every process reads its "go" by then.
START_DELAY_S = 0.2


class NotTogether(Exception):
    """A device's process did not start or stopped stepping: the node keeps its alone figures."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.bench.together", description=__doc__.split("\n")[0])
    p.add_argument("--node", help="node name, for the frames")
    p.add_argument("--model", required=True, help="model spec to time (docs/bench.md)")
    p.add_argument("--job", help="devices, batches and windows (JSON, see above)")
    p.add_argument("--lifeline", action="store_true", help="exit when stdin reaches EOF")
    # a child
    p.add_argument("--serve", action="store_true", help="one device's process (started by this program)")
    p.add_argument("--device", help="--serve: gpuN or cpu")
    p.add_argument("--speed", type=float, help="--serve: emulated speed; absent for a real device")
    p.add_argument("--batches", help="--serve: one batch per phase, comma-separated")
    p.add_argument("--warmup", type=int, default=2, help="--serve: untimed steps per batch before the start")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    if args.lifeline:
        watch_stdin()
    job = json.loads(args.job)
    try:
        measured = run_together(args.model, job, lambda stage: emit(
            {"type": FrameType.PROGRESS, "node": args.node, "device": "together", "stage": stage}))
    except Exception as exc:  # a device that cannot step beside the others: the alone figures stand
        why = str(exc) if isinstance(exc, NotTogether) else first_line(exc)
        emit({"type": FrameType.NOTE, "node": args.node, "device": "together",
              "message": f"devices together not measured: {why}"})
        return 0
    emit({"type": FrameType.TOGETHER, "node": args.node,
          "devices": {device: to_dict(profile) for device, profile in measured.items()}})
    return 0


def run_together(spec: str, job: dict[str, Any], progress: Callable[[str], None]) -> dict[str, TogetherProfile]:
    """Start a process per device of ``job``, start them together, end every phase for all of them
    at once when each has its counted steps and the phase its least length (or at its most), and
    summarise each device's phases."""
    devices = job["devices"]
    phases = len(devices[0]["batches"])
    least_s, most_s, steps = float(job["least_s"]), float(job["most_s"]), int(job["steps"])
    children: list[subprocess.Popen[bytes]] = []
    errors: list[IO[bytes]] = []
    try:
        progress(f"starting {len(devices)} processes")
        for d in devices:
            argv = [sys.executable, "-m", "hgcli.node.bench.together", "--serve", "--model", spec,
                    "--device", d["device"], "--batches", ",".join(str(int(b)) for b in d["batches"]),
                    "--warmup", str(int(job.get("warmup", 2)))]
            if d.get("speed") is not None:
                argv += ["--speed", repr(float(d["speed"]))]
            # Each in a session of its own, as the node agent starts each rank (node/agent/ranks.py):
            # where the kernel shares the CPU between sessions first (autogroup scheduling, on by default
            # in most distributions), a rank competes for the cores as a session, not as one process of
            # a shared one.
            # stderr to a file: a pipe nobody reads until the end could fill and stop the child.
            errors.append(tempfile.TemporaryFile())
            children.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=errors[-1], env=os.environ.copy(), start_new_session=True))
        readers = [_Lines(child, err) for child, err in zip(children, errors)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for reader, d in zip(readers, devices):
            if reader.line(deadline) != "ready":
                raise NotTogether(f"{d['device']} did not start: {reader.failure()}")
        begin = time.monotonic() + START_DELAY_S
        _tell(children, f"go {begin!r}")
        for phase in range(phases):
            progress(f"{len(devices)} devices stepping together, phase {phase + 1} of {phases}")
            begin = _phase(readers, devices, begin, least_s, most_s, steps)
            _tell(children, f"end {begin!r}")
        out: dict[str, TogetherProfile] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        for reader, d in zip(readers, devices):
            line = reader.line(deadline)
            while line == "step":
                line = reader.line(deadline)
            if not line.startswith("["):
                raise NotTogether(f"{d['device']} failed while stepping: {reader.failure()}")
            out[d["device"]] = TogetherProfile(devices=len(devices), steps=tuple(
                summarize_phase(int(b), seconds) for b, seconds in zip(d["batches"], json.loads(line)) if seconds))
        return out
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for err in errors:
            err.close()


def _phase(readers: list[_Lines], devices: list[dict[str, Any]], begin: float, least_s: float, most_s: float,
           steps: int) -> float:
    """Count each process's finished steps ("step" lines) from ``begin``; return when the phase may
    end: every device has ``steps`` of them after its transition step and ``least_s`` has passed, or
    ``most_s`` has (a device too slow for ``steps`` on a busy node keeps what it has)."""
    counts = [0] * len(readers)
    while True:
        for i, r in enumerate(readers):
            counts[i] += sum(1 for line in r.complete() if line == "step")
        now = time.monotonic()
        if now >= begin + most_s or (now >= begin + least_s and min(counts) >= steps + SKIP_FIRST):
            return now
        ready = select.select([r.fd for r in readers], [], [], begin + most_s - now)[0]
        for i, r in enumerate(readers):
            if r.fd in ready and not r.fill():
                raise NotTogether(f"{devices[i]['device']} failed while stepping: {r.failure()}")


def _tell(children: list[subprocess.Popen[bytes]], line: str) -> None:
    for child in children:
        assert child.stdin is not None
        child.stdin.write(f"{line}\n".encode())
        child.stdin.flush()


def summarize_phase(batch: int, seconds: list[float]) -> TogetherStep:
    return TogetherStep(batch_size=batch,
                        seconds=Measurement(median=statistics.median(seconds), min=min(seconds),
                                            max=max(seconds), repeats=len(seconds)),
                        mean_s=statistics.fmean(seconds))


class _Lines:
    """Lines of a pipe with a deadline (os.read on the descriptor: no buffered reader that could hold
    a line select() does not see)."""

    def __init__(self, child: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
        assert child.stdout is not None
        self.child, self.stderr, self.fd, self.buf = child, stderr, child.stdout.fileno(), b""

    def line(self, deadline: float) -> str:
        """The next line, or "" when the child closed its stdout or the deadline passed."""
        return _read_line(self, deadline)

    def fill(self) -> bool:
        """Read what the pipe holds (it is readable); False at end of file."""
        chunk = os.read(self.fd, 65536)
        self.buf += chunk
        return bool(chunk)

    def complete(self) -> list[str]:
        """The complete lines read so far, taken out of the buffer."""
        *lines, self.buf = self.buf.split(b"\n")
        return [line.decode(errors="replace").strip() for line in lines]

    def failure(self) -> str:
        """Why the child gave no line: its exit and last stderr line, or that it is still running."""
        try:
            code = self.child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "no answer in time"
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return f"exit code {code}: {lines[-1] if lines else 'no output'}"


class _Stdin:
    """This process's stdin as lines, without blocking between steps."""

    def __init__(self) -> None:
        self.fd, self.buf = sys.stdin.fileno(), b""

    def line(self, deadline: float) -> str:
        return _read_line(self, deadline)

    def poll(self) -> str | None:
        """A line that has arrived ("" at end of file), else None at once."""
        if b"\n" in self.buf or select.select([self.fd], [], [], 0)[0]:
            return self.line(time.monotonic() + 1.0)
        return None


def _read_line(source: _Lines | _Stdin, deadline: float) -> str:
    while b"\n" not in source.buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([source.fd], [], [], left)[0]:
            return ""
        chunk = os.read(source.fd, 65536)
        if not chunk:
            return ""
        source.buf += chunk
    line, _, source.buf = source.buf.partition(b"\n")
    return line.decode(errors="replace").strip()


# ---------------------------------------------------------------------------------------------
# One device's process
# ---------------------------------------------------------------------------------------------

def serve(args: argparse.Namespace) -> None:
    import torch

    from ...runtime.emulate import Emulator
    from .modelspec import load, parse_spec
    from .step import default_loss, runtime_hooks

    batches = [int(b) for b in args.batches.split(",")]
    emulated = args.speed is not None
    if emulated:
        torch.set_num_threads(1)     # an emulated rank runs torch on one thread
    if emulated or args.device == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(args.device[3:]))
        torch.cuda.set_device(device)
    sync: Callable[[], object] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    loaded = load(parse_spec(args.model))
    model = loaded.model.to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss_fn = loaded.loss_fn or default_loss(torch)
    data = {}
    for b in set(batches):
        inputs, targets = loaded.make_batch(b, device)
        data[b] = ((*(inputs if isinstance(inputs, tuple) else (inputs,)), targets),
                   torch.randperm(b, device=device))
    # The runtime's hooks with this device's emulator: the engine pauses in the optimizer's pre-hook
    # as a rank's does, after the step's compute, for (its stable CPU estimate) / speed.
    with runtime_hooks(model, optimizer, default_batch=min(batches),
                       emulator=Emulator(args.speed if emulated else 1.0)) as log:

        def step(batch: int) -> None:
            tensors, order = data[batch]
            *xb, yb = (t[order] if isinstance(t, torch.Tensor) and t.dim() else t for t in tensors)
            loss = loss_fn(model(*xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            value = loss.item()
            optimizer.step()
            log(step=0, loss=value, samples=batch)
            sync()

        for b in batches:
            for _ in range(args.warmup):
                step(b)
        print("ready", flush=True)
        commands = _Stdin()
        command = commands.line(time.monotonic() + READY_TIMEOUT_S).split()
        if len(command) != 2 or command[0] != "go":
            return
        _sleep_until(float(command[1]))
        phases = _phases(step, batches, commands)
        if phases is None:
            return
    print(json.dumps(phases), flush=True)


def _phases(step: Callable[[int], None], batches: list[int], commands: "_Stdin") -> list[list[float]] | None:
    """Step each batch in turn until the parent ends its phase ("end T"); each phase's step times that
    finished by T, the first SKIP_FIRST dropped. None when the parent is gone or says something else."""
    phases: list[list[float]] = []
    for batch in batches:
        seconds: list[tuple[float, float]] = []     # (finished at, took) of each step
        while True:
            t = time.monotonic()
            step(batch)
            done = time.monotonic()
            seconds.append((done, done - t))
            print("step", flush=True)
            line = commands.poll()     # "" once the parent is gone: stop below
            if line is not None:
                command = line.split()
                break
        if len(command) != 2 or command[0] != "end":
            return None
        # the step running when the phase ended is not wholly inside it
        end = float(command[1])
        phases.append([took for finished, took in seconds if finished <= end][SKIP_FIRST:])
    return phases


def _sleep_until(t: float) -> None:
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


if __name__ == "__main__":
    sys.exit(main())
