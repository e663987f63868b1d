"""The human output of bench: tables with EMULATED markers and errors; progress only on a terminal."""
from __future__ import annotations

import io

from rich.console import Console

from hgcli.bench.cluster import BenchEvent, failure_summary
from hgcli.schema.stages import (DeviceProfile, LinkProfile, Measurement, ModelSpec, Profiles, StepSample,
                                 TogetherProfile, TogetherStep)
from hgcli.render.bench import BenchProgress, render_profiles

M = Measurement(2.5, 2.0, 3.0, 5)


def sample() -> Profiles:
    return Profiles(cluster="c", devices=(
        DeviceProfile("n1", "gpu0", "Tesla T4", True, 0.25, 15360, matmul_tflops={"fp32": M},
                      mem_bandwidth_gbs=M, steps=(StepSample(16, Measurement(0.004, 0.003, 0.005, 5), 9),)),
        DeviceProfile("n1", "gpu1", "Tesla T4", True, 0.25, 4, error="out of memory at batch 16"),
        DeviceProfile("n2", "cpu", "EPYC [7B13]", False, 1.0, 24000, matmul_tflops={"fp32": M}),
    ), links=(LinkProfile("n1", "n2", "gloo", M, Measurement(2e-4, 1e-4, 3e-4, 20)),
              LinkProfile("n1", "n3", "gloo", error="n3: connection refused")),
        model=ModelSpec("mlp", 669706))


def rendered(profiles: Profiles) -> str:
    console = Console(file=io.StringIO(), width=250, record=True)
    render_profiles(profiles, console)
    return console.export_text()


def test_tables_mark_emulated_devices_and_show_errors():
    text = rendered(sample())
    assert text.count("EMULATED x0.25") == 2
    assert "out of memory at batch 16" in text and "n3: connection refused" in text
    assert "EPYC [7B13]" in text                 # markup-like names are printed, not interpreted
    assert "4 (16)" in text                      # step time in ms at batch 16
    assert "200" in text                         # link latency in µs
    assert "669,706 parameters" in text


def test_a_device_benched_together_shows_its_mean_step_beside_the_others():
    profiles = sample()
    assert "together:" not in rendered(profiles)
    together = TogetherProfile(2, (TogetherStep(16, Measurement(0.011, 0.009, 0.02, 8), 0.0125),))
    first = profiles.devices[0]
    text = rendered(Profiles(cluster="c", devices=(DeviceProfile(
        first.node, first.device, first.name, True, 0.25, 15360, steps=first.steps, together=together),)))
    assert "12.5 (16)" in text                   # the together window's mean step, ms at batch 16
    assert "together: the mean step while every device of the node stepped at once" in text


def test_failure_summary_counts_devices_and_links():
    assert failure_summary(sample()) == "1 of 3 devices and 1 of 2 links failed; their errors are in the profiles"
    ok = Profiles(cluster="c", devices=sample().devices[:1])
    assert failure_summary(ok) is None


def test_progress_is_silent_off_a_terminal():
    out = io.StringIO()
    with BenchProgress(Console(file=out, force_terminal=False)) as progress:
        progress(BenchEvent("n1", "gpu0", "matmul fp32"))
    assert out.getvalue() == ""


def test_progress_shows_each_node_on_a_terminal():
    out = io.StringIO()
    with BenchProgress(Console(file=out, force_terminal=True, width=120)) as progress:
        progress(BenchEvent("n1", "gpu0", "matmul fp32"))
        progress(BenchEvent("n2", "cpu", "batch 64"))
        progress(BenchEvent("n1", "gpu1", "memory bandwidth"))
    text = out.getvalue()
    assert "n1" in text and "gpu1: memory bandwidth" in text and "cpu: batch 64" in text
