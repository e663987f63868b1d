"""The PS exchange at real model sizes, against a raw TCP transfer and a gloo all-reduce of the same bytes.

Each configuration is a real job of the runtime (``hgcli.local.run_plan``: one group leader and S
``python -m hgcli.runtime.ps`` shards, the same processes as under the launcher): a flat model of N
parameters (eight tensors) and AdamW; the leader sets a gradient and calls ``opt.step()``, which is
the exchange: the push into the staging buffer, send/recv to each shard, the shards' AdamW steps, the
answers back into the parameters. Per configuration:

  round trip    median time of ``opt.step()`` on the leader;
  update        median time of a shard's optimizer step per push (its trace), the slowest shard;
  exchange B/s  (push bytes + answer bytes) / (round trip - update): what the transport moves;
  raw B/s       the same bytes there and back between two plain processes over one TCP socket,
                on the same link, in the same run (Python sockets, sendall / recv_into);
  plain step    the same torch optimizer (AdamW, torch's default implementation) over tensors of a
                shard's share in a plain process with the shard's threads; update / plain step;
  memory        a shard's peak RSS beyond its RSS once joined to the job, over its share of the parameters' fp32
                bytes (goal <= 4.5: parameters, two moments, one staging buffer), and the leader's
                peak beyond its RSS with the model and its gradients held (goal <= 2).
  all-reduce    a gloo all_reduce of the same N fp32 values between two plain processes.

Links: ``loopback``, and ``netns`` (the shards in a network namespace of their own, joined to the
leader's by a veth pair, no rate limit; needs root and iproute2). Readable table, then one JSON
line with every figure and a ``goals`` object.

    PYTHONPATH=. .venv/bin/python benchmarks/ps_exchange.py                 (the full grid, ~15 min)
    PYTHONPATH=. .venv/bin/python benchmarks/ps_exchange.py --sizes 25 --shards 1,2 --links loopback
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
TENSORS = 8
MEMORY_GOAL_SHARD = 4.5
MEMORY_GOAL_LEADER = 2.0
BYTES_GOAL = 0.7
UPDATE_GOAL = 1.2


# --- the leader (a worker rank of the job) ------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    import torch

    import hgcli.runtime as hg
    from hgcli.runtime.ps.server import memory_kb

    ctx = hg.init()
    per = args.parameters // TENSORS
    model = torch.nn.Module()
    model.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per) * 0.01) for _ in range(TENSORS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    grads = [torch.full_like(p, 1e-3) for p in model.parameters()]
    held_kb = memory_kb("VmRSS")          # the model and its gradients, as any training holds them
    model, opt = ctx.wrap(model, opt)
    times = []
    for _ in range(args.warmup + args.repeats):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    ctx.finish()
    (Path(args.out) / "leader.json").write_text(json.dumps(
        {"times": times[args.warmup:], "held_kb": held_kb, "peak_kb": memory_kb("VmHWM")}))
    return 0


# --- baselines ----------------------------------------------------------------------------------
def raw_echo(argv: list[str]) -> int:
    """``--echo PORT BYTES REPEATS``: receive BYTES, send them back, REPEATS times."""
    port, n, repeats = int(argv[0]), int(argv[1]), int(argv[2])
    with socket.create_server(("0.0.0.0", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            buf = memoryview(bytearray(n))
            for _ in range(repeats):
                _recv_all(conn, buf)
                conn.sendall(buf)
    return 0


def _recv_all(conn: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        k = conn.recv_into(buf[got:], len(buf) - got)
        if not k:
            raise ConnectionError("peer closed")
        got += k


def raw_round_trip(n_bytes: int, repeats: int, prefix: list[str], addr: str) -> float:
    """Median seconds to send ``n_bytes`` to a plain echo process and get them back."""
    port = _free_port()
    echo = subprocess.Popen([*prefix, sys.executable, __file__, "--echo", str(port), str(n_bytes), str(repeats + 1)])
    try:
        conn = _connect(addr, port)
        buf = memoryview(bytearray(n_bytes))
        times = []
        with conn:
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                conn.sendall(buf)
                _recv_all(conn, buf)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        echo.wait(timeout=120)


def _connect(addr: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection((addr, port), timeout=120)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def allreduce_child(argv: list[str]) -> int:
    """``--allreduce RANK PORT N REPEATS``: one of two plain gloo ranks; rank 0 prints the median."""
    import torch
    import torch.distributed as dist

    rank, port, n, repeats = (int(a) for a in argv)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    t = torch.ones(n)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"allreduce_s": statistics.median(times[1:])}), flush=True)
    dist.destroy_process_group()
    return 0


def allreduce_time(n: int, repeats: int) -> float:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--allreduce", str(r), str(port), str(n), str(repeats)],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    return float(json.loads(out.strip().splitlines()[-1])["allreduce_s"])


def plain_step_child(argv: list[str]) -> int:
    """``--plain NUMEL THREADS REPEATS``: AdamW's default implementation over eight tensors of NUMEL
    values in all, the median step time (and a fused flat one, for reference)."""
    import torch

    numel, threads, repeats = (int(a) for a in argv)
    torch.set_num_threads(threads)
    out = {}
    for name, tensors, kw in (("default", [torch.zeros(numel // TENSORS) for _ in range(TENSORS)], {}),
                              ("fused_flat", [torch.zeros(numel)], {"fused": True})):
        for t in tensors:
            t.grad = torch.full_like(t, 1e-3)
        opt = torch.optim.AdamW(tensors, lr=1e-4, **kw)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[1:])
        del opt, tensors
    print(json.dumps(out), flush=True)
    return 0


def plain_step(numel: int, threads: int, repeats: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--plain", str(numel), str(threads), str(repeats)],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --- links --------------------------------------------------------------------------------------
@contextlib.contextmanager
def link(kind: str) -> Iterator[dict[str, Any]]:
    if kind == "loopback":
        yield {"master_addr": "127.0.0.1", "node_prefix": {}, "node_env": {}, "echo_prefix": [],
               "echo_addr": "127.0.0.1"}
        return
    tag = str(os.getpid() % 100000)
    ns, dev_a, dev_b = f"hgtps{tag}", f"hgpa{tag}", f"hgpb{tag}"
    a, b = "10.214.0.1", "10.214.0.2"

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        sh("ip", "link", "set", dev_b, "netns", ns)
        sh("ip", "addr", "add", f"{a}/24", "dev", dev_a)
        sh("ip", "link", "set", dev_a, "up")
        sh("ip", "-n", ns, "addr", "add", f"{b}/24", "dev", dev_b)
        sh("ip", "-n", ns, "link", "set", dev_b, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        prefix = ["ip", "netns", "exec", ns]
        yield {"master_addr": a, "node_prefix": {"ps": prefix},
               "node_env": {"ps": {"GLOO_SOCKET_IFNAME": dev_b, "TP_SOCKET_IFNAME": dev_b},
                            "leader": {"GLOO_SOCKET_IFNAME": dev_a, "TP_SOCKET_IFNAME": dev_a}},
               "echo_prefix": prefix, "echo_addr": b}
    finally:
        subprocess.run(["ip", "link", "del", dev_a], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# --- one configuration --------------------------------------------------------------------------
def run_one(n: int, shards: int, wire: str, net: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from hgcli.local.plans import emulated_plan
    from hgcli.local.run import run_plan
    from hgcli.runtime.env import ps_argv
    from hgcli.runtime.ps.shards import plan_layout

    plan = emulated_plan([[1.0]], [[1]], n_ps=shards, nodes=[["leader"]], ps_node="ps", wire=wire,
                         strategy=None)
    with tempfile.TemporaryDirectory(prefix="hgtrain-psx-") as tmp:
        work = Path(tmp)
        result = run_plan(plan, [sys.executable, __file__, "--worker", "--parameters", str(n), "--out", tmp,
                                 "--warmup", str(args.warmup), "--repeats", str(args.repeats)],
                          workdir=work, ps_argv=ps_argv(), timeout_s=1800,
                          rank_timeout_s=600, master_addr=net["master_addr"],
                          node_prefix=net["node_prefix"], node_env=net["node_env"],
                          extra_env={"HGTRAIN_LOG_LEVEL": "warning"})
        if not result.ok:
            bad = result.first_failure or result.ranks[0]
            raise SystemExit(f"ps_exchange: the job of {n} parameters, {shards} shards, {wire} failed:\n"
                             f"{bad.output()[-3000:]}")
        leader = json.loads((work / "leader.json").read_text())
    events = result.metrics            # the shards' metrics events (ps.py): ps_ready, ps_push, ps_end
    wire_bytes = 2 if wire == "bf16" else 4
    per_push: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") == "ps_push":
            per_push.setdefault(e["version"], []).append(e["update_s"])
    # The slowest shard's update of each push, over the measured pushes (the last ``repeats``).
    updates = [max(v) for _, v in sorted(per_push.items())][-args.repeats:]
    ready = {e["shard"]: e for e in events if e.get("event") == "ps_ready"}   # joined, nothing held yet
    end = {e["shard"]: e for e in events if e.get("event") == "ps_end"}
    layout = plan_layout([(n // TENSORS,)] * TENSORS, [0] * TENSORS, shards, elementwise=True)
    shard_mem = [(end[s]["peak_rss_kb"] - ready[s]["rss_kb"]) * 1024 / (layout.size(s) * 4) for s in range(shards)]
    round_trip = statistics.median(leader["times"])
    update = statistics.median(updates)
    moved = 2 * n * wire_bytes
    return {"parameters": n, "shards": shards, "wire": wire, "round_trip_s": round_trip, "update_s": update,
            "exchange_bytes_per_s": moved / max(1e-9, round_trip - update), "bytes": moved,
            "threads": ready[0]["threads"], "impl": end[0].get("impl"), "shard_memory_x": max(shard_mem),
            "leader_memory_x": (leader["peak_kb"] - leader["held_kb"]) * 1024 / (n * 4),
            "share": max(layout.size(s) for s in range(shards))}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("--echo", "--allreduce", "--plain"):
        return {"--echo": raw_echo, "--allreduce": allreduce_child, "--plain": plain_step_child}[sys.argv[1]](
            sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parameters", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="25,100,350", help="model sizes, millions of parameters")
    p.add_argument("--shards", default="1,2,4")
    p.add_argument("--wires", default="fp32,bf16")
    p.add_argument("--links", default="loopback,netns")
    p.add_argument("--netns-sizes", default="100", help="sizes run over the netns link")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    sizes = [int(float(s) * 1e6) // TENSORS * TENSORS for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    raw: dict[tuple[str, int], float] = {}
    allreduce: dict[int, float] = {}
    plain: dict[tuple[int, int], dict[str, float]] = {}
    for kind in args.links.split(","):
        with link(kind) as net:
            run_sizes = sizes if kind == "loopback" else \
                [int(float(s) * 1e6) // TENSORS * TENSORS for s in args.netns_sizes.split(",")]
            for n in run_sizes:
                for wire in args.wires.split(","):
                    moved = n * (2 if wire == "bf16" else 4)
                    if (kind, moved) not in raw:
                        raw[(kind, moved)] = raw_round_trip(moved, args.repeats, net["echo_prefix"], net["echo_addr"])
                    for shards in (int(s) for s in args.shards.split(",")):
                        row = run_one(n, shards, wire, net, args)
                        row["link"] = kind
                        row["raw_bytes_per_s"] = 2 * moved / raw[(kind, moved)]
                        key = (row["share"], row["threads"])
                        if key not in plain:
                            plain[key] = plain_step(row["share"], row["threads"], args.repeats)
                        row["plain_step_s"] = plain[key]["default"]
                        row["plain_fused_flat_s"] = plain[key]["fused_flat"]
                        rows.append(row)
                        print(f"  {kind} {n / 1e6:.0f}M {shards} shard(s) {wire}: round trip "
                              f"{row['round_trip_s']:.3f} s", flush=True)
                if kind == "loopback" and n not in allreduce:
                    allreduce[n] = allreduce_time(n, args.repeats)
    print()
    head = (f"{'link':9} {'params':>7} {'sh':>2} {'wire':5} {'trip s':>7} {'upd s':>6} {'GB/s':>5} {'raw':>5} "
            f"{'x raw':>5} {'plain s':>7} {'x pl':>5} {'mem sh':>6} {'mem ld':>6} {'allred s':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        r["bytes_x_raw"] = r["exchange_bytes_per_s"] / r["raw_bytes_per_s"]
        r["update_x_plain"] = r["update_s"] / r["plain_step_s"]
        r["allreduce_s"] = allreduce.get(r["parameters"])
        ar = f"{r['allreduce_s']:.3f}" if r["allreduce_s"] else "-"
        print(f"{r['link']:9} {r['parameters'] / 1e6:>6.0f}M {r['shards']:>2} {r['wire']:5} {r['round_trip_s']:>7.3f} "
              f"{r['update_s']:>6.3f} {r['exchange_bytes_per_s'] / 1e9:>5.2f} {r['raw_bytes_per_s'] / 1e9:>5.2f} "
              f"{r['bytes_x_raw']:>5.2f} {r['plain_step_s']:>7.3f} {r['update_x_plain']:>5.2f} "
              f"{r['shard_memory_x']:>6.2f} {r['leader_memory_x']:>6.2f} {ar:>8}")
    print(f"\nthreads per shard: {sorted({r['threads'] for r in rows})}; PS optimizer: "
          f"{sorted({str(r['impl']) for r in rows})}; exchange GB/s = bytes / (round trip - update)")
    goals = {
        "bytes_at_least_0.7x_raw": all(r["bytes_x_raw"] >= BYTES_GOAL for r in rows),
        "update_at_most_1.2x_plain": all(r["update_x_plain"] <= UPDATE_GOAL for r in rows),
        "shard_memory_at_most_4.5x": all(r["shard_memory_x"] <= MEMORY_GOAL_SHARD for r in rows),
        "leader_memory_at_most_2x": all(r["leader_memory_x"] <= MEMORY_GOAL_LEADER for r in rows),
    }
    print(json.dumps({"benchmark": "ps_exchange", "rows": rows, "goals": goals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
