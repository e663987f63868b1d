"""A process's own peak memory, for tests that bound it."""
from __future__ import annotations

import subprocess
import time


def peak_rss_kib(proc: subprocess.Popen, poll_s: float = 0.01) -> int:
    """``proc``'s peak resident memory in KiB (``VmHWM``: kept per address space, from its exec on),
    polled until it exits. Not ``wait4``'s ``ru_maxrss``: for a child spawned with vfork (as
    subprocess does) that starts from the parent's own high-water mark, pytest's."""
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except OSError:
            pass   # it is exiting
        time.sleep(poll_s)
    return peak
