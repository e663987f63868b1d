"""One short check of hgtrain's real-GPU paths, for a machine with an NVIDIA GPU (none here).

    OUT=/tmp/gpucheck python3 benchmarks/gpu_check.py

Prepared to run once on a lent machine of one H200 within 9 minutes: every step has its own time
limit (LIMITS below, 505 s in all), and a step that runs out is killed with its whole process group
(torchrun's and the launcher's ranks too), so it cannot hold the GPU or a port for the next one. In
this order, on the embedded local cluster (this machine, its real GPUs) and a fresh state dir:
  1. nvidia-smi with the probe's own query (raw CSV kept: tests/fakes/nvidia-smi's `h200` scenario is
     such a capture), then `hgtrain probe --json` (the probe's parse of it, torch's CUDA version);
  2. torchrun on CUDA, and the peer: `torchrun --standalone --nproc-per-node 1` runs
     hgcli.examples.train (the README's main job, default flags) through this file's `peer` mode,
     which prints the `ctx.device` that `hg.init()` gave the script without any hgtrain plan. It must
     be cuda:LOCAL_RANK; "cpu" fails the step loudly and the example is not run (its wall time would
     be a CPU's). Otherwise the example's samples/s is the peer of step 7's launch;
  3. `ctx.wrap` against plain torch: this file's `wrap-bench` mode under torchrun nproc 1 (a world
     of one) times a ResNet-50-sized net built here (bottlenecks 3-4-6-3, 25.6M parameters, batch 64
     of 224x224 random images, SGD with momentum) as plain torch and as `ctx.wrap(model, opt)`,
     interleaved in one process (A/B/A/B blocks of steps, warm-up first, torch.cuda.synchronize
     around each timed block), in fp32 and under bf16 autocast: median step times, ratio
     plain/wrapped (goal: fp32's >= 0.97; bf16's is reported);
  4. a hybrid plan of the GPU and emulated CPU devices exchanging through a PS: a cluster file
     ($OUT/hybrid.toml) of two nodes on this machine (a node's devices are either real or emulated,
     so: node "gpu", localhost, gpus = [0]; node "emu", localhost, two emulated devices of speed 1),
     then `hgtrain launch -c $OUT/hybrid.toml --strategy hybrid --json -- python -m
     hgcli.examples.train --quick` (through the `peer` mode, so each rank's ctx.device is logged):
     exit code, samples/s (measured and predicted), accuracy, which nodes held workers;
  5. `hgtrain bench --json` of the embedded cluster (matmul fp32/bf16/fp16, memory and host-to-device
     bandwidth, the example model's step time per batch on the GPU);
  6. `hgtrain plan --json` (it must reuse the stored profiles: its stderr is checked for a re-bench);
  7. `hgtrain launch --json` of the README's main job at global batch 32 (the default for one
     device): measured samples/s against the plan's prediction and against step 2's peer;
  8. tests/runtime/test_gpu.py: NCCL groups of real-GPU ranks with a PS, and the named error for a
     model left on the CPU (a two-GPU test runs where there are two).
Left out to fit the 9 minutes: nvidia-smi with units, the probe's table, the launch at global batch
2048 (its figure is in docs/bench.md) and `launch --strategy ps` (a GPU worker pushing to a CPU PS
over RPC: step 4 does that).
A GPU machine of one card cannot host an NCCL group of two ranks: NCCL 2.28.9 answered "invalid
usage" (two ranks on one device) on an H200; hence step 4's emulated second group.

Without CUDA (no nvidia-smi, or torch without CUDA) it says so and skips every GPU step; it still
writes $OUT/hybrid.toml and checks it with hgtrain's cluster-file loader, and runs step 3's
wrap-bench at tiny sizes on the CPU as a smoke test (not a figure), in well under a minute.

Writes $OUT/log.txt (everything), $OUT/smi.csv, $OUT/probe.json, $OUT/bench.json, $OUT/plan.json,
$OUT/hybrid.toml, $OUT/summary.json (the figures); prints a table, then one JSON line of the figures
with `goals` (true/false; null where the step did not run). Exit 0 always: the log says which step
failed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
PY = sys.executable
HG = [PY, "-m", "hgcli"]
TRAIN_MODULE = "hgcli.examples.train"
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
# This file's child modes, as torchrun and the launcher start them.
PEER = [str(HERE), "peer"]
WRAP_BENCH = [str(HERE), "wrap-bench"]

# Seconds per step; their sum (505) leaves the 9-minute lease room for the machine's own start-up.
LIMITS = {"smi": 10, "probe": 30, "torchrun": 60, "wrap": 75, "hybrid": 120, "bench": 60, "plan": 20,
          "launch_gb32": 50, "test_gpu": 80}
WRAP_GOAL = 0.97
# wrap-bench's sizes for a CPU: a 9k-parameter net of the same layout, a few steps.
TINY_WRAP = ["--batch", "4", "--image", "32", "--width", "8", "--blocks", "1,1", "--classes", "10",
             "--warmup", "1", "--rounds", "2", "--steps", "2"]
DEVICE_LINE = "gpu_check: ctx.device"
RESULT_LINE = "gpu_check: result "
FINAL = re.compile(r"final test accuracy (\d\.\d+) after ([\d.]+) s .*this rank trained on (\d+) samples")

OUT = Path(".")
summary: dict[str, Any] = {}


# --- running steps -------------------------------------------------------------------------------

def say(text: str) -> None:
    print(text, flush=True)
    with open(OUT / "log.txt", "a") as fh:
        fh.write(text + "\n")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """The step's whole process group: torchrun's workers and the launcher's ranks would otherwise
    outlive their parent and keep the GPU's memory and the rendezvous port from the next step."""
    for sig in (signal.SIGTERM, signal.SIGKILL):    # SIGKILL too: a member may ignore SIGTERM
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def step(name: str, argv: list[str], save: str | None = None) -> tuple[int, str, str]:
    """Run ``argv`` under LIMITS[name]; its exit code and wall time go into the summary."""
    limit_s = LIMITS[name]
    say(f"\n=== {name} (limit {limit_s} s): {' '.join(argv)}")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        rc, out, err = 127, "", str(exc)
    else:
        try:
            out, err = proc.communicate(timeout=limit_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:   # something outside the group still holds the pipes
                out, err = "", "(gpu_check: the output was lost: the pipes stayed open)"
            rc = 124
            err += f"\n(gpu_check: killed after its limit of {limit_s} s)"
    wall = time.monotonic() - t0
    if save:
        (OUT / save).write_text(out)
    say(out[-6000:] if not save else f"(stdout in {save}, {len(out)} chars)")
    if err.strip():
        say("--- stderr:\n" + err[-4000:])
    say(f"=== {name}: exit {rc}, {wall:.1f} s")
    summary[f"{name}_exit"] = rc
    summary[f"{name}_wall_s"] = round(wall, 2)
    return rc, out, err


def fail(name: str, why: str) -> None:
    say(f"!!! {name} FAILED: {why}")
    summary.setdefault("failed", []).append(f"{name}: {why}")


def skip(names: list[str], why: str) -> None:
    say(f"--- skipped {', '.join(names)}: {why}")
    summary.setdefault("skipped", []).extend(names)


def json_lines(out: str) -> list[dict[str, Any]]:
    """The JSON objects of ``out``, one a line (the launcher's --json events); other lines skipped."""
    docs = []
    for line in out.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def job_ended(out: str) -> dict[str, Any]:
    """The launcher's job_ended event (its summary, exit code); {} when the job never got there."""
    return next((e for e in json_lines(out) if e.get("event") == "job_ended"), {})


def environment() -> bool:
    """Versions into the log; True when there is a GPU to check (nvidia-smi and CUDA in torch)."""
    import torch
    cuda = torch.cuda.is_available()
    say(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"available {cuda}, devices {torch.cuda.device_count()}, "
        f"nccl {torch.cuda.nccl.version() if cuda else None}")
    summary.update(torch=torch.__version__, cuda_available=cuda)
    if shutil.which("nvidia-smi") is None or not cuda:
        say(f"NO GPU: nvidia-smi {'missing' if shutil.which('nvidia-smi') is None else 'present'}, "
            f"torch.cuda.is_available() {cuda}; the GPU steps are skipped")
        return False
    return True


# --- step 1: nvidia-smi and the probe ------------------------------------------------------------

def smi_and_probe() -> None:
    from hgcli.node.gpus import QUERY_FIELDS
    step("smi", ["nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"],
         save="smi.csv")
    step("probe", HG + ["probe", "--json"], save="probe.json")


# --- step 2: torchrun on CUDA, and the peer ------------------------------------------------------

def peer_main(argv: list[str]) -> int:
    """Child mode: run hgcli.examples.train (with ``argv``) after printing the ``ctx.device`` that
    its ``hg.init()`` returns. ``--require-cuda``: stop (exit 3) when CUDA is present but the device
    is the CPU, so the caller does not time a CPU run as if it were the GPU's."""
    import runpy

    import torch

    import hgcli.runtime as hg

    require = "--require-cuda" in argv
    args = [a for a in argv if a != "--require-cuda"]
    real_init = hg.init

    def init(**kwargs: Any) -> Any:
        ctx = real_init(**kwargs)
        print(f"{DEVICE_LINE} {ctx.device} (rank {ctx.rank}, LOCAL_RANK {os.environ.get('LOCAL_RANK')})",
              flush=True)
        if require and torch.cuda.is_available() and ctx.device.type != "cuda":
            print(f"gpu_check: FAIL: hg.init() under torchrun gave ctx.device {ctx.device} with CUDA "
                  f"present: the example would train on the CPU; not running it", flush=True)
            raise SystemExit(3)
        return ctx

    hg.init = init      # train.py calls hg.init() through the module, so it gets this one
    sys.argv = [TRAIN_MODULE] + args
    runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    return 0


def devices_in(out: str) -> list[str]:
    return re.findall(re.escape(DEVICE_LINE) + r" (\S+)", out)


def torchrun_peer() -> None:
    rc, out, _ = step("torchrun", TORCHRUN + PEER + ["--require-cuda"])
    devices = devices_in(out)
    summary["torchrun_device"] = devices[0] if devices else None
    local_rank = "0"      # nproc 1
    summary["torchrun_on_cuda"] = bool(devices) and devices[0] == f"cuda:{local_rank}"
    if not devices:
        fail("torchrun", "the script printed no ctx.device (it failed before or in hg.init())")
    elif not summary["torchrun_on_cuda"]:
        fail("torchrun", f"ctx.device under plain torchrun is {devices[0]}, not cuda:{local_rank}")
    final = FINAL.search(out)
    if rc == 0 and final and summary["torchrun_on_cuda"]:
        acc, secs, samples = float(final[1]), float(final[2]), int(final[3])
        summary["peer"] = {"accuracy": acc, "train_s": secs, "samples_per_s": round(samples / secs, 1)}
    elif rc != 0:
        fail("torchrun", f"exit {rc}")


# --- step 3: ctx.wrap against plain torch --------------------------------------------------------

def resnet50_like(width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> Any:
    """ResNet-50's layout by hand (torchvision does not load here): a 7x7 stem, bottleneck stages
    of ``blocks`` with 4x expansion, global pooling and a linear head. 25,557,032 parameters at the
    defaults; smaller ``width``/``blocks`` give the CPU smoke test's net."""
    from torch import nn

    def bn_conv(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(*bn_conv(cin, mid, 1), nn.ReLU(inplace=True),
                                      *bn_conv(mid, mid, 3, stride), nn.ReLU(inplace=True),
                                      *bn_conv(mid, cout, 1))
            self.skip = (nn.Sequential(*bn_conv(cin, cout, 1, stride)) if stride != 1 or cin != cout
                         else nn.Identity())

        def forward(self, x: Any) -> Any:
            return (self.body(x) + self.skip(x)).relu()

    layers: list[nn.Module] = [*bn_conv(3, width, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, n in enumerate(blocks):
        mid = width * 2 ** i
        for j in range(n):
            layers.append(Bottleneck(cin, mid, 2 if (j == 0 and i > 0) else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def timed_blocks(variants: dict[str, Callable[[], None]], *, rounds: int, steps: int,
                 sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds per step of each variant, over ``rounds`` of A/B/... blocks of ``steps``
    steps; interleaving gives every variant the same clocks, temperature and allocator state."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, one_step in variants.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step()
            sync()
            times[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def wrap_bench_main(argv: list[str]) -> int:
    """Child mode: plain torch against ``ctx.wrap`` on one device, world of one; prints one
    ``gpu_check: result {json}`` line."""
    p = argparse.ArgumentParser(prog="gpu_check.py wrap-bench")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--blocks", default="3,4,6,3")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--no-bf16", action="store_true")
    args = p.parse_args(argv)

    import contextlib

    import torch
    import torch.nn.functional as F

    import hgcli.runtime as hg

    torch.manual_seed(0)
    ctx = hg.init()
    cuda = torch.cuda.is_available()
    # Both variants on the same device; the GPU of LOCAL_RANK even if ctx.device says otherwise
    # (recorded as ctx_device, so a mismatch shows).
    device = ctx.device if ctx.device.type == "cuda" or not cuda else \
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    blocks = tuple(int(b) for b in args.blocks.split(","))
    plain = resnet50_like(args.width, blocks, args.classes).to(device)
    wrapped = copy.deepcopy(plain)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    wrapped, wrapped_opt = ctx.wrap(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9))
    x = torch.randn(args.batch, 3, args.image, args.image, device=device)
    y = torch.randint(0, args.classes, (args.batch,), device=device)

    def stepper(model: Any, opt: Any, amp: Any) -> Callable[[], None]:
        def one_step() -> None:
            with amp():
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return one_step

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    amps: dict[str, Callable[[], Any]] = {"fp32": contextlib.nullcontext}
    if not args.no_bf16:
        amps["bf16"] = lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    result: dict[str, Any] = {"device": str(device), "ctx_device": str(ctx.device), "batch": args.batch,
                              "image": args.image, "params": sum(p.numel() for p in plain.parameters())}
    for name, amp in amps.items():
        variants = {"plain": stepper(plain, plain_opt, amp), "wrapped": stepper(wrapped, wrapped_opt, amp)}
        timed_blocks(variants, rounds=1, steps=args.warmup, sync=sync)     # warm-up: cudnn, allocator
        medians = timed_blocks(variants, rounds=args.rounds, steps=args.steps, sync=sync)
        result[name] = {"plain_ms": round(medians["plain"] * 1e3, 3),
                        "wrapped_ms": round(medians["wrapped"] * 1e3, 3),
                        "ratio": round(medians["plain"] / medians["wrapped"], 4)}
    ctx.finish()
    print(RESULT_LINE + json.dumps(result), flush=True)
    return 0


def result_of(out: str) -> dict[str, Any] | None:
    found = [line[len(RESULT_LINE):] for line in out.splitlines() if line.startswith(RESULT_LINE)]
    return json.loads(found[-1]) if found else None


def wrap_vs_plain(argv: list[str], name: str = "wrap") -> None:
    rc, out, _ = step(name, argv)
    result = result_of(out)
    summary[name] = result
    if result is None:
        fail(name, f"exit {rc}, no result line")
    elif result["device"] != result["ctx_device"]:
        say(f"note: ctx.device was {result['ctx_device']}; both variants ran on {result['device']}")


# --- step 4: the GPU and emulated CPU devices through a PS ---------------------------------------

def hybrid_cluster_toml(path: Path, *, python: str = PY, gpu: bool = True) -> Path:
    """Two nodes on this machine: "gpu" with the real GPU 0, "emu" with two emulated devices of
    speed 1 (a CPU core each). Two nodes because a node's devices are all real or all emulated
    (``emulate`` replaces what nvidia-smi reports). ``gpu=False``: node "gpu" emulates one device
    instead, for trying the flow on a machine without one."""
    gpu_devices = ("gpus = [0]" if gpu else
                   'emulate = { devices = ["stand-in for the GPU"], speed = [1.0], memory_mib = [16384] }')
    path.write_text(
        "# gpu_check step 4: the real GPU as one group, emulated CPU devices as another, and a PS.\n"
        f'[[nodes]]\nname = "gpu"\nhost = "localhost"\npython = {json.dumps(python)}\n{gpu_devices}\n\n'
        f'[[nodes]]\nname = "emu"\nhost = "localhost"\npython = {json.dumps(python)}\n'
        'emulate = { devices = ["CPU (emulated)", "CPU (emulated)"], speed = [1.0, 1.0], '
        "memory_mib = [16384, 16384] }\n")
    path.chmod(0o600)       # hgtrain refuses a cluster file that others can write
    return path


def check_cluster_file(path: Path) -> bool:
    from hgcli.config.cluster import load_cluster
    try:
        cluster = load_cluster(path)
    except Exception as exc:        # the loader's own errors name file:line; show them as they are
        fail("hybrid", f"{path} does not load: {exc}")
        return False
    say(f"{path}: nodes {', '.join(n.name for n in cluster.nodes)}")
    return True


def hybrid_figures(out: str) -> dict[str, Any]:
    """From the launcher's --json events: the job's summary, and whether each node held a worker."""
    events = json_lines(out)
    workers = {e["node"] for e in events if e.get("event") == "rank_started" and e.get("role") == "worker"}
    ps = [e for e in events if e.get("event") == "rank_started" and e.get("role") == "ps"]
    ended = job_ended(out)
    s = ended.get("summary") or {}
    return {"state": ended.get("state"), "exit_code": ended.get("exit_code"), "strategy": s.get("strategy"),
            "worker_nodes": sorted(workers), "ps_ranks": len(ps), "samples_per_s": s.get("samples_per_s"),
            "predicted_samples_per_s": s.get("predicted_samples_per_s"), "accuracy": s.get("accuracy"),
            "group_samples_per_s": s.get("groups"), "rank_devices": devices_in(out)}


def hybrid() -> None:
    path = hybrid_cluster_toml(OUT / "hybrid.toml")
    if not check_cluster_file(path):
        return
    rc, out, _ = step("hybrid", HG + ["launch", "-c", str(path), "--strategy", "hybrid", "--json", "--"]
                      + [PY] + PEER + ["--quick"])
    fig = hybrid_figures(out)
    summary["hybrid"] = fig
    summary["hybrid_ok"] = ok = hybrid_ok(rc, fig)
    if not ok:
        fail("hybrid", f"exit {rc}, state {fig['state']}, worker nodes {fig['worker_nodes']}, "
                       f"PS ranks {fig['ps_ranks']}, groups {fig['group_samples_per_s']}, "
                       f"rank devices {fig['rank_devices']}")


def hybrid_ok(rc: int, fig: dict[str, Any]) -> bool:
    """Trained to the end with workers on both nodes, the GPU's rank on CUDA, and at least two groups
    exchanging through a PS: devices of one speed class would be planned as one all-reduce group
    without a PS, which is not what this step checks."""
    return (rc == 0 and fig["state"] == "succeeded" and fig["strategy"] == "hybrid" and fig["ps_ranks"] >= 1
            and len(fig["group_samples_per_s"] or {}) >= 2 and fig["worker_nodes"] == ["emu", "gpu"]
            and "cuda:0" in fig["rank_devices"])


# --- steps 5-8: bench, plan, launch, tests -------------------------------------------------------

def bench_plan_launch() -> None:
    step("bench", HG + ["bench", "--json"], save="bench.json")
    _, _, err = step("plan", HG + ["plan", "--json"], save="plan.json")
    summary["plan_rebenched"] = "benching" in err      # it must reuse the stored profiles
    _, out, _ = step("launch_gb32", HG + ["launch", "--json", "--global-batch", "32", "--", PY, "-m",
                                          TRAIN_MODULE])
    result = job_ended(out).get("summary") or {}
    summary["launch_gb32_result"] = result
    measured = result.get("samples_per_s")
    peer = (summary.get("peer") or {}).get("samples_per_s")
    if measured and peer:
        summary["launch_gb32_vs_peer"] = round(measured / peer, 3)


def gpu_tests() -> None:
    step("test_gpu", [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/runtime/test_gpu.py"])


# --- the report ----------------------------------------------------------------------------------

def goals() -> dict[str, bool | None]:
    ratio = ((summary.get("wrap") or {}).get("fp32") or {}).get("ratio")
    return {f"wrap_vs_plain_ge_{WRAP_GOAL}": (ratio >= WRAP_GOAL if ratio else False)
            if "wrap_exit" in summary else None,
            "torchrun_on_cuda": summary.get("torchrun_on_cuda"),
            "hybrid_gpu_plus_emulated_ok": summary.get("hybrid_ok")}


def table() -> str:
    rows = []
    for key, label in (("wrap", "wrap vs plain"), ("wrap_smoke_cpu", "CPU smoke, not a figure")):
        wrap = summary.get(key) or {}
        for amp in ("fp32", "bf16"):
            if amp in wrap:
                w = wrap[amp]
                rows.append((f"{label}, {amp}", f"plain {w['plain_ms']} ms, wrapped {w['wrapped_ms']} ms, "
                                                f"ratio {w['ratio']} on {wrap['device']}"))
    if "torchrun_exit" in summary:
        rows.append(("torchrun ctx.device", str(summary.get("torchrun_device"))))
    if summary.get("peer"):
        rows.append(("peer (torchrun example)", f"{summary['peer']['samples_per_s']} samples/s, "
                                                f"accuracy {summary['peer']['accuracy']}"))
    h = summary.get("hybrid")
    if h:
        rows.append(("hybrid GPU + emulated", f"exit {h['exit_code']}, {h['samples_per_s']} samples/s "
                                              f"(predicted {h['predicted_samples_per_s']}), "
                                              f"accuracy {h['accuracy']}, workers on {h['worker_nodes']}"))
    launch = summary.get("launch_gb32_result") or {}
    if launch:
        rows.append(("launch gb32", f"{launch.get('samples_per_s')} samples/s (predicted "
                                    f"{launch.get('predicted_samples_per_s')}), vs peer "
                                    f"{summary.get('launch_gb32_vs_peer')}"))
    for key in sorted(k for k in summary if k.endswith("_exit")):
        rows.append((f"exit {key[:-5]}", f"{summary[key]} ({summary.get(key[:-5] + '_wall_s')} s)"))
    for name, met in summary["goals"].items():
        rows.append((f"goal {name}", {True: "MET", False: "NOT MET", None: "not run"}[met]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def report() -> None:
    summary["goals"] = goals()
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    say("\n" + table())
    say(json.dumps(summary, default=str))


# --- main ----------------------------------------------------------------------------------------

def cpu_smoke() -> None:
    """No GPU: the cluster file of step 4 through hgtrain's loader, and step 3's child at tiny sizes
    (does the code run; its times are not figures)."""
    LIMITS["wrap_smoke_cpu"] = 60
    check_cluster_file(hybrid_cluster_toml(OUT / "hybrid.toml"))
    wrap_vs_plain(TORCHRUN + WRAP_BENCH + TINY_WRAP, name="wrap_smoke_cpu")


def main() -> int:
    global OUT
    OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpucheck-"))
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["HGTRAIN_STATE_DIR"] = tempfile.mkdtemp(prefix="hgstate-")
    os.environ["PYTHONUNBUFFERED"] = "1"
    # The checkout's hgcli for every child (ranks, torchrun workers), not an installed copy's.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    say(f"gpu_check: OUT {OUT}, step limits {sum(LIMITS.values())} s in all")
    t0 = time.monotonic()
    if environment():
        smi_and_probe()
        torchrun_peer()
        wrap_vs_plain(TORCHRUN + WRAP_BENCH)
        hybrid()
        bench_plan_launch()
        gpu_tests()
    else:
        skip(["smi", "probe", "torchrun", "wrap", "hybrid", "bench", "plan", "launch_gb32", "test_gpu"],
             "no GPU")
        cpu_smoke()
    summary["total_wall_s"] = round(time.monotonic() - t0, 1)
    report()
    return 0


if __name__ == "__main__":
    # Run as a file, Python puts benchmarks/ first on sys.path: the checkout's hgcli must win over
    # an installed one in this process and in the child modes too.
    sys.path.insert(0, str(REPO))
    modes = {"peer": peer_main, "wrap-bench": wrap_bench_main}
    if len(sys.argv) > 1 and sys.argv[1] in modes:
        sys.exit(modes[sys.argv[1]](sys.argv[2:]))
    sys.exit(main())
