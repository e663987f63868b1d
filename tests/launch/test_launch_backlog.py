"""A flood into a slow reader: every line arrives, in order, and the controller's memory stays bounded.

The real CLI (``python -m hgcli launch``) on a local node, its stdout a pipe the test reads slowly; the
controller's peak RSS from the kernel (``VmHWM``). The console's backlog is bounded by
``Dispatcher.MAX_BACKLOG_BYTES`` (16 MiB) in memory, the rest waits in the spill file; the inbox from
the agents by ``agentlink.INBOX_BYTES`` (8 MiB). The spill file's order is tested in
test_launch_render.py.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

from tests.peakrss import peak_rss_kib

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

LINES = 64 * 1024
FLOOD = f"""
import sys
w = sys.stdout.write
pad = 'p' * 1000
for i in range({LINES}):
    w(f'{{i:08d}} {{pad}}\\n')
"""   # 64 MiB of 1 KiB lines, as fast as the rank can print them


def test_flood_into_a_slow_pipe_loses_nothing_and_memory_stays_bounded(hg, tmp_path):
    cluster = local_cluster(("a",))
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    pfile = plan_file(tmp_path, make_plan(cluster, [["a"]]))
    proc = subprocess.Popen([sys.executable, "-m", "hgcli", "launch", "-c", str(ctoml), "--plan", str(pfile), "--",
                             sys.executable, "-c", FLOOD], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=hg.env(), cwd=tmp_path)
    hg.procs.append(proc)
    got = {"lines": 0, "last": -1, "ordered": True}

    def slow_reader() -> None:
        """Reads nothing until the rank's whole flood is in the controller's rank file (the
        slowest reader there is), then everything."""
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            logs = [hg.job_dir(j) / "rank0.log" for j in hg.job_ids()]
            if logs and logs[0].is_file() and logs[0].stat().st_size >= LINES * 1010:
                break
            time.sleep(0.1)
        rest = b""
        while True:
            chunk = proc.stdout.read1(256 * 1024)
            if not chunk:
                break
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                number = int(line.split(b"| ", 1)[1][:8])
                got["ordered"] &= number == got["last"] + 1
                got["last"] = number
                got["lines"] += 1

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    peak = peak_rss_kib(proc)
    reader.join(60)
    assert proc.returncode == 0
    assert got["lines"] == LINES and got["ordered"]
    # Held in memory it was the whole backlog: 90 MB peak here. Bounded: 16 MiB for the console and
    # 8 MiB for the controller's inbox beyond its own ~30 MB (47 MB measured, 55 MB at load 13).
    assert peak < 64 * 1024, peak
