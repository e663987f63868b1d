"""Device micro-benchmarks: matmul throughput, memory bandwidth, host-to-device bandwidth.

Each returns a Measurement over repeated timings (see timing.py). torch arrives as an argument from
the caller, which imported it lazily: this module itself never imports torch at import time.
"""
from __future__ import annotations

from typing import Any, Callable

from ...schema.stages import Measurement
from .timing import WALL, Clock, rates, time_repeats

Sync = Callable[[], object]


def matmul_tflops(torch: Any, device: Any, dtype: Any, n: int, *, inner: int, warmup: int,
                  repeats: int, sync: Sync,
                  clock: Clock = WALL) -> Measurement:
    """TFLOP/s of n x n matmuls (2 n^3 FLOPs each); ``inner`` back-to-back per timing so that a
    fast GPU's launch overhead and timer resolution do not dominate."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def run() -> None:
        for _ in range(inner):
            torch.matmul(a, b, out=out)

    seconds = time_repeats(run, warmup=warmup, repeats=repeats, sync=sync, clock=clock)
    return rates(2.0 * n ** 3 * inner / 1e12, seconds)


def memory_bandwidth_gbs(torch: Any, device: Any, nbytes: int, *, warmup: int, repeats: int,
                         sync: Sync, clock: Clock = WALL) -> Measurement:
    """GB/s of a device-to-device copy of ``nbytes``: every byte is read once and written once,
    so the traffic is 2 x nbytes (the convention of STREAM's copy kernel)."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = time_repeats(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, sync=sync, clock=clock)
    return rates(2.0 * src.numel() * 4 / 1e9, seconds)


def h2d_bandwidth_gbs(torch: Any, device: Any, nbytes: int, *, warmup: int, repeats: int,
                      sync: Sync, clock: Clock = WALL) -> Measurement:
    """GB/s from pinned host memory to the GPU: the path every training batch takes."""
    host = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty(host.numel(), device=device, dtype=torch.float32)
    seconds = time_repeats(lambda: dev.copy_(host, non_blocking=True), warmup=warmup,
                           repeats=repeats, sync=sync, clock=clock)
    return rates(host.numel() * 4 / 1e9, seconds)
