"""The node-side device benchmark as the controller runs it: a real subprocess, real torch, on the CPU."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hgcli.schema.stages import DeviceProfile, Measurement, StepSample, from_dict
from hgcli.node.bench.main import group_batch
from hgcli.node.bench import modelspec
from hgcli.node.bench.group import summarize_pairs
from hgcli.node.frames import decode

ROOT = Path(__file__).resolve().parents[2]


def run_node_bench(*args: str, cwd: Path = ROOT) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # mlp unless a test names its model: its memory grows visibly with the batch (the default,
    # the bundled example's model, is too small for the memory assertions).
    model = [] if "--model" in args else ["--model", "mlp"]
    proc = subprocess.run([sys.executable, "-m", "hgcli.node.bench", "--node", "n1", "--quick", *model, *args],
                          capture_output=True, text=True, env=env, timeout=240, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    # split("\n"), not splitlines(): the frame marker \x1e is a line boundary to splitlines.
    return [f for f in map(decode, proc.stdout.split("\n")) if f is not None]


@functools.lru_cache(maxsize=None)
def cpu_bench() -> tuple[dict, ...]:
    """The frames of ``--device cpu`` with the defaults and ``--group-ranks 3``, run once per session:
    four tests read the same measurement (it is not changed by reading it), and each run costs a
    torch import and a bench. A real device ignores --group-ranks (its group step is not benched)."""
    return tuple(run_node_bench("--device", "cpu", "--group-ranks", "3"))


@functools.lru_cache(maxsize=None)
def slow_emulated_bench() -> tuple[dict, ...]:
    """An emulated T4 at x1e-6, run once per session: one test reads how it is marked, another how
    far its figures are scaled from the CPU's own."""
    return tuple(run_node_bench("--device", "gpu1", "--name", "Tesla T4", "--emulate-speed", "1e-6",
                                "--memory-mib", "15360"))


def profile_of(frames: list[dict] | tuple[dict, ...]) -> DeviceProfile:
    (frame,) = [f for f in frames if f["type"] == "profile"]
    return from_dict(DeviceProfile, frame["profile"])


def test_cpu_device_measures_matmul_bandwidth_and_steps():
    frames = cpu_bench()
    p = profile_of(frames)
    assert (p.node, p.device, p.emulated, p.speed, p.error) == ("n1", "cpu", False, 1.0, None)
    fp32 = p.matmul_tflops["fp32"]
    assert 0 < fp32.min <= fp32.median <= fp32.max and fp32.repeats >= 3
    assert p.mem_bandwidth_gbs is not None and p.mem_bandwidth_gbs.median > 0
    assert p.h2d_bandwidth_gbs is None                    # no host-to-device copy on a CPU
    assert [s.batch_size for s in p.steps] == [4, 16, 64, 256]
    assert all(s.seconds.median > 0 and s.memory_mib > 0 for s in p.steps)
    # Activations grow with the batch, so the accounted peak does too.
    assert p.steps[-1].memory_mib > p.steps[0].memory_mib
    assert p.torch_version and p.memory_total_mib and p.memory_total_mib > 0
    (model,) = [f for f in frames if f["type"] == "model"]
    assert model["parameters"] == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert any(f["type"] == "progress" and f["stage"] == "batch 64" for f in frames)
    # A real PS push (send/recv with an RPC control message) to a child process: a model-sized one costs more than a one-element
    # one, and the PS's own busy time is part of the model-sized round trip.
    ex = p.exchange
    assert ex is not None and ex.bytes == 4 * model["parameters"]
    assert 0 < ex.latency_s.min and 0 < ex.service_s.median < ex.round_trip_s.median
    assert ex.latency_s.median < ex.round_trip_s.median


def test_emulated_device_is_marked_and_scaled():
    frames = slow_emulated_bench()
    p = profile_of(frames)
    assert (p.device, p.name, p.emulated, p.speed, p.memory_total_mib, p.error) == \
        ("gpu1", "Tesla T4", True, 1e-6, 15360, None)
    assert any(f["type"] == "note" and "emulated" in f["message"] and "x1e-06" in f["message"] for f in frames)
    assert p.driver_version is None and p.h2d_bandwidth_gbs is None


def test_emulation_factor_is_applied_to_what_was_measured():
    """The same CPU measured as itself and as a x1e-6 device: rates shrink and times grow by a
    factor far beyond the run-to-run noise of a busy machine (which stays within 1000x)."""
    real = profile_of(cpu_bench())
    slow = profile_of(slow_emulated_bench())
    assert slow.matmul_tflops["fp32"].median < real.matmul_tflops["fp32"].median / 1000
    assert slow.mem_bandwidth_gbs.median < real.mem_bandwidth_gbs.median / 1000
    assert slow.steps[0].seconds.median > real.steps[0].seconds.median * 1000
    assert slow.steps[0].memory_mib == real.steps[0].memory_mib   # memory is not scaled


def test_group_ranks_time_a_synchronous_step_of_the_nodes_emulated_devices():
    """Three real gloo processes run the benched model's step like emulated ranks, in blocks free
    and synchronous: the all-reduce's time and the CPU ratio are the node's figures; a real device's
    bench does not measure them."""
    frames = run_node_bench("--device", "gpu0", "--emulate-speed", "0.1", "--model", "mlp@8,16,32",
                            "--group-ranks", "3", "--no-exchange")
    p = profile_of(frames)
    (model,) = [f for f in frames if f["type"] == "model"]
    g = p.group_sync
    assert g is not None and g.ranks == 3
    # what the runtime's group all-reduces per step (engine.py): the gradient, then the small
    # all-reduce of the sample count and MEMBER_SLOTS (5) per rank
    assert g.bytes == 4 * (model["parameters"] + 1 + 5 * 3)
    # the largest benched batch whose emulated step is at most 0.2 s, at the device's speed
    assert g.batch == 32 and g.speed == 0.1 and p.steps[2].seconds.median <= 0.2
    assert g.step_s > 0
    assert 0 <= g.seconds.min <= g.seconds.median <= g.seconds.max and g.seconds.repeats >= 12
    assert g.seconds.median > 0            # a 2.7 MB all-reduce among three processes takes time
    # the same ranks' CPU per step, synchronous over free: a ratio near 1, measured on every pair
    r = g.compute_ratio
    assert r is not None and r.repeats == g.seconds.repeats and 0.3 < r.min <= r.median <= r.max < 3
    assert any(f["type"] == "progress" and f["stage"] == "synchronous step of 3 ranks" for f in frames)
    assert profile_of(cpu_bench()).group_sync is None     # benched with --group-ranks 3 too


def test_group_pairs_drop_the_warm_up_and_pool_the_ranks_cpu():
    """Per pair after the warm-up: rank 0's all-reduce seconds, and the ranks' mean CPU per step
    synchronous over their mean free."""
    def pair(free: float, sync: float, wait: float) -> dict:
        return {"free_cpu": free, "free_step": 0.05, "sync_cpu": sync, "sync_wait": wait}

    blocks = [[pair(9.0, 1.0, 9.0), pair(1.0, 1.2, 0.004), pair(2.0, 2.0, 0.006)],
              [pair(9.0, 1.0, 9.0), pair(3.0, 3.6, 0.5), pair(2.0, 3.0, 0.5)]]
    added, ratios = summarize_pairs(blocks, warmup=1)
    assert added == [0.004, 0.006]
    assert ratios == pytest.approx([1.2, 1.25])


def test_the_group_bench_takes_the_largest_batch_whose_emulated_step_fits_else_the_smallest():
    def steps(*seconds: float) -> list[StepSample]:
        return [StepSample(b, Measurement(median=t, min=t, max=t, repeats=3), 1)
                for b, t in zip((4, 16, 64, 128), seconds)]

    # unscaled CPU seconds; at speed 0.1 the emulated step is 10x: 0.05, 0.1, 0.2, 0.4 s
    assert group_batch(steps(0.005, 0.01, 0.02, 0.04), 0.1) == 64
    assert group_batch(steps(0.005, 0.01, 0.02, 0.04), 1.0) == 128
    assert group_batch(steps(0.03, 0.04, 0.05, 0.06), 0.1) == 4     # none fits: the smallest


def test_step_over_emulated_memory_is_out_of_memory_and_keeps_smaller_batches():
    # Learn the accounted peaks, then cap the memory between batch 64 and batch 256: deterministic,
    # because the accounting counts tensor storages, not timing.
    peaks = {s.batch_size: s.memory_mib for s in profile_of(cpu_bench()).steps}
    assert peaks[64] < peaks[256]
    # --no-exchange: the node's PS exchange was timed with another of its devices (bench/cluster.py)
    p = profile_of(run_node_bench("--device", "gpu0", "--emulate-speed", "1", "--memory-mib", str(peaks[64]),
                                  "--no-exchange"))
    assert p.exchange is None and profile_of(slow_emulated_bench()).exchange is not None
    assert [s.batch_size for s in p.steps] == [4, 16, 64]
    assert p.error.startswith("out of memory at batch 256")
    assert f"the emulated device has {peaks[64]} MiB" in p.error
    assert p.matmul_tflops["fp32"].median > 0                # measured before the failure: kept


def test_missing_gpu_is_the_device_error():
    p = profile_of(run_node_bench("--device", "gpu0"))      # no --emulate-speed: a real GPU is wanted
    if p.error is None:
        pytest.skip("this machine has a CUDA GPU")
    assert "CUDA" in p.error and p.device == "gpu0" and p.steps == ()


def test_model_from_a_file_spec_with_own_batch_sizes(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Linear(8, 2)\n"
        "    def batch(n, device):\n"
        "        return torch.randn(n, 8, device=device), torch.randn(n, 2, device=device)\n"
        "    return model, batch, torch.nn.functional.l1_loss\n")
    frames = run_node_bench("--device", "cpu", "--model", "mymodel.py:build@4,8", cwd=tmp_path)
    p = profile_of(frames)
    assert p.error is None and [s.batch_size for s in p.steps] == [4, 8]
    assert [f["parameters"] for f in frames if f["type"] == "model"] == [18]


def test_model_that_cannot_load_is_the_device_error(tmp_path):
    p = profile_of(run_node_bench("--device", "cpu", "--model", "nosuch_module_xyz:build"))
    assert p.error.startswith("cannot load model nosuch_module_xyz:build: ModuleNotFoundError")
    assert p.matmul_tflops["fp32"].median > 0 and p.steps == ()


@pytest.mark.parametrize("spec, target, factory, is_file, batches", [
    ("mlp", "hgcli.examples.models", "mlp", False, None),
    ("mlp@8,32", "hgcli.examples.models", "mlp", False, (8, 32)),
    ("pkg.models:resnet", "pkg.models", "resnet", False, None),
    ("./m.py:build@2", "./m.py", "build", True, (2,)),
    ("dir/m:build", "dir/m", "build", True, None),
])
def test_parse_spec(spec, target, factory, is_file, batches):
    ref = modelspec.parse_spec(spec)
    assert (ref.spec, ref.target, ref.factory, ref.is_file, ref.batch_sizes) == (spec, target, factory, is_file, batches)


@pytest.mark.parametrize("spec, message", [
    ("resnet", "expected MODULE:FACTORY"),
    ("pkg.models:", "is not a function name"),
    ("pkg models:f", "neither a module name"),
    ("mlp@0,8", "batch sizes must be positive"),
])
def test_parse_spec_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        modelspec.parse_spec(spec)


def test_bad_device_argument_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "hgcli.node.bench", "--node", "n", "--device", "tpu0"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 2 and "gpuN or cpu" in proc.stderr


def test_the_example_spec_times_the_model_under_the_examples_autocast():
    """bench's default model is the ResNet as hgcli.examples.train runs it: under its --amp choice."""
    import torch

    from hgcli.examples.resnet import spec

    for amp, dtype in (("bf16", torch.bfloat16), ("off", torch.float32)):
        model, make_batch = spec(amp=amp)
        inputs, _ = make_batch(2, "cpu")
        assert model(inputs).dtype == dtype
