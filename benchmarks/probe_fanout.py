"""Probe fan-out: hgtrain vs a serial OpenSSH loop vs pdsh, on 1, 4 and 16 real sshd test hosts.

    PYTHONPATH=. python3 benchmarks/probe_fanout.py [--repeats 3]

Every host is a real sshd on its own loopback address (tests/sshhosts.py) with the fake
nvidia-smi of tests/fakes. All three tools query the same hosts in the same run:
- hgtrain: in-process ``probe_cluster`` (fresh connections every run; the package is already
  shipped by a warm-up run, as it is on every probe after the first);
- serial: ``ssh -o BatchMode=yes <host> nvidia-smi --query-gpu=... --format=csv,noheader,nounits``
  for one host after the other;
- pdsh: ``pdsh -R ssh -w host[1-N]`` running the same query (its default fan-out of 32).
Both OpenSSH-based tools use one generated ssh config naming each host's port, key and known_hosts.
Then ``hgtrain --help`` (``python -m hgcli --help``) beside ``python -c pass``.

On a 2-core machine every sshd shares the cores with the client, so absolute times are bounded by
CPU; compare the tools within one run. Prints a table, then one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hgcli.schema.stages import Cluster  # noqa: E402
from hgcli.probe.inventory import probe_cluster  # noqa: E402
from tests.sshhosts import TestHosts, start_hosts  # noqa: E402

COUNTS = (1, 4, 16)
QUERY = ["nvidia-smi", "--query-gpu=index,name,uuid,memory.total,memory.used,compute_cap,driver_version",
         "--format=csv,noheader,nounits"]


def ssh_config(hosts: TestHosts, path: Path) -> Path:
    blocks = []
    for h in hosts:
        blocks.append("\n".join([
            f"Host {h.name}", f"  HostName {h.address}", f"  Port {h.port}", "  User root",
            f"  IdentityFile {hosts.client_key}", "  IdentitiesOnly yes", f"  UserKnownHostsFile {hosts.known_hosts}",
            "  StrictHostKeyChecking yes", "  BatchMode yes", "  LogLevel ERROR", ""]))
    path.write_text("\n".join(blocks))
    return path


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_of(repeats: int, fn) -> float:
    return statistics.median(timed(fn) for _ in range(repeats))


def run_hgtrain(hosts: TestHosts, count: int) -> None:
    inventory = probe_cluster(Cluster(nodes=hosts.nodes(hosts.hosts[:count]), ssh=hosts.ssh_settings()))
    bad = [n for n in inventory.nodes if not n.ok or len(n.gpus) != 2]
    if bad:
        raise SystemExit(f"hgtrain probe failed: {bad}")


def run_serial(hosts: TestHosts, count: int, config: Path) -> None:
    for h in hosts.hosts[:count]:
        out = subprocess.run(["ssh", "-F", str(config), h.name, *QUERY], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120)
        if out.returncode != 0 or len(out.stdout.splitlines()) != 2:
            raise SystemExit(f"ssh {h.name} failed: {out.stderr}")


def run_pdsh(hosts: TestHosts, count: int, config: Path) -> None:
    env = {**os.environ, "PDSH_SSH_ARGS": f"-F {config} %h"}
    names = ",".join(h.name for h in hosts.hosts[:count])
    out = subprocess.run(["pdsh", "-R", "ssh", "-w", names, *QUERY], capture_output=True, text=True, env=env,
                         stdin=subprocess.DEVNULL, timeout=120)
    if out.returncode != 0 or len(out.stdout.splitlines()) != 2 * count:
        raise SystemExit(f"pdsh failed ({out.returncode}): {out.stderr}")


def cli_times(repeats: int) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(args: list[str]) -> None:
        subprocess.run([sys.executable, *args], check=True, capture_output=True, env=env)

    run(["-m", "hgcli", "--help"])   # warm the bytecode cache
    return (median_of(repeats, lambda: run(["-m", "hgcli", "--help"])),
            median_of(repeats, lambda: run(["-c", "pass"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (the median is shown)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hgtrain-bench-") as tmp:
        os.environ["HGTRAIN_STATE_DIR"] = str(Path(tmp) / "state")
        hosts = start_hosts(Path(tmp) / "hosts", max(COUNTS))
        try:
            for h in hosts:
                h.set_gpus("a100x2")
            config = ssh_config(hosts, Path(tmp) / "ssh_config")
            cold = timed(lambda: run_hgtrain(hosts, max(COUNTS)))   # ships the package to every host
            tools = {"hgtrain_s": lambda n: run_hgtrain(hosts, n),
                     "serial_ssh_s": lambda n: run_serial(hosts, n, config),
                     "pdsh_s": lambda n: run_pdsh(hosts, n, config)}
            rows = {}
            for count in COUNTS:
                # Interleaved repeats: a burst of load from elsewhere hits every tool alike.
                samples: dict[str, list[float]] = {name: [] for name in tools}
                for _ in range(args.repeats):
                    for name, tool in tools.items():
                        samples[name].append(timed(lambda: tool(count)))
                rows[count] = {name: statistics.median(values) for name, values in samples.items()}
        finally:
            hosts.stop()
    help_s, pass_s = cli_times(max(5, args.repeats))

    print(f"{'hosts':>5}  {'hgtrain':>9}  {'serial ssh':>10}  {'pdsh':>9}  {'hg/pdsh':>7}  {'hg/serial':>9}")
    for count, r in rows.items():
        print(f"{count:>5}  {r['hgtrain_s']:>8.3f}s  {r['serial_ssh_s']:>9.3f}s  {r['pdsh_s']:>8.3f}s  "
              f"{r['hgtrain_s'] / r['pdsh_s']:>7.2f}  {r['hgtrain_s'] / r['serial_ssh_s']:>9.2f}")
    print(f"first hgtrain probe of {max(COUNTS)} hosts, shipping the package: {cold:.3f}s")
    print(f"hgtrain --help: {help_s:.3f}s   python -c pass: {pass_s:.3f}s   (median of {max(5, args.repeats)})")
    top = rows[max(COUNTS)]
    print(json.dumps({
        "benchmark": "probe_fanout",
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "hosts": {str(c): {k: round(v, 4) for k, v in r.items()} for c, r in rows.items()},
        "hgtrain_cold_16_s": round(cold, 4),
        "ratio_hgtrain_over_pdsh_16": round(top["hgtrain_s"] / top["pdsh_s"], 3),
        "ratio_hgtrain_over_serial_16": round(top["hgtrain_s"] / top["serial_ssh_s"], 3),
        "goal_ratio_hgtrain_over_pdsh_16": 1.0,
        "help_s": round(help_s, 4),
        "python_pass_s": round(pass_s, 4),
        "ratio_help_over_python_pass": round(help_s / pass_s, 2),
    }))


if __name__ == "__main__":
    main()
