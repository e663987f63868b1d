"""Measure the link between two nodes through torch.distributed; runs ON each of the two nodes.

    rank 0 (node A): python -m hgcli.node.bench.link --rank 0 --addr A_ADDR --backend gloo [--quick]
    rank 1 (node B): python -m hgcli.node.bench.link --rank 1 --addr A_ADDR --port P --backend gloo

Rank 0 opens a TCPStore on a free port (port 0: the kernel picks it, so no race with other
programs) and emits ``{"type": "listening", "port": P}``; the controller then starts rank 1 with
that port. Both form a 2-rank process group with the backend training will use (gloo; NCCL when
both nodes have CUDA) and time all-reduces: a 4-byte one for latency and a large one for bandwidth.
Each rank emits ``{"type": "link", ...}`` with its measurements, or ``{"type": "error"}``. Every
wait is bounded by ``--timeout``; a watchdog ends the process if the collective itself hangs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import threading
from typing import Any

from ...runtime.netbind import interface_for, master_store
from ...schema.stages import to_dict
from .failure import first_line
from ..frames import emit
from ..protocol import FrameType
from .lifeline import watch_stdin
from .timing import rates, summarize, time_repeats

MIB = 1 << 20
# (bandwidth message bytes, warm-up, repeats for bandwidth, repeats for latency)
QUICK = (8 * MIB, 1, 4, 20)
FULL = (64 * MIB, 2, 10, 100)
EXIT_HUNG = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.bench.link")
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--addr", required=True, help="node A's address as node B reaches it")
    p.add_argument("--port", type=int, default=0, help="rank 0's store port (rank 1 only)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for every wait")
    p.add_argument("--lifeline", action="store_true", help="exit when stdin reaches EOF")
    args = p.parse_args(argv)
    if args.rank == 1 and not args.port:
        p.error("rank 1 needs --port (printed by rank 0)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.lifeline:
        watch_stdin()
    _watchdog(args.timeout * 3)
    try:
        emit({"type": FrameType.LINK, **measure(args)})
    except Exception as exc:  # a refused connection or a timed-out collective: reported, not raised
        emit({"type": FrameType.ERROR, "message": first_line(exc)})
        return 1
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.rank == 0:
        store = master_store(args.addr, 0, 2, timeout, wait_for_workers=False)
        emit({"type": FrameType.LISTENING, "port": store.port})
        _bind_interface(args.addr, args.backend)
    else:
        _bind_interface(_local_address_towards(args.addr, args.port), args.backend)
        store = dist.TCPStore(args.addr, args.port, 2, False, timeout=timeout)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=2, timeout=timeout)
    try:
        nbytes, warmup, bw_repeats, lat_repeats = QUICK if args.quick else FULL
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        small = torch.ones(1, device=device)
        latency = time_repeats(lambda: dist.all_reduce(small), warmup=5, repeats=lat_repeats, sync=sync)
        big = torch.ones(nbytes // 4, device=device)
        # A 2-rank ring all-reduce sends and receives the whole message once per rank
        # (bus bandwidth 2(n-1)/n x size / time with n = 2), so size / time is the link's rate.
        bandwidth = time_repeats(lambda: dist.all_reduce(big), warmup=warmup, repeats=bw_repeats, sync=sync)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"backend": args.backend, "bytes": nbytes,
            "bandwidth_gbs": to_dict(rates(nbytes / 1e9, bandwidth)),
            "latency_s": to_dict(summarize(latency))}


def _local_address_towards(addr: str, port: int) -> str:
    """The local IPv4 address the kernel routes to ``addr`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, port))
        return s.getsockname()[0]


def _bind_interface(local_addr: str, backend: str) -> None:
    """Make gloo/NCCL use the interface that holds ``local_addr``.

    By default gloo binds to the address the machine's hostname resolves to, often 127.0.1.1 on
    Debian, which the peer cannot reach. A user's own GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins.
    """
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        return
    try:
        name = interface_for(local_addr)
    except OSError:
        return
    if name is not None:
        os.environ[var] = name


def _watchdog(seconds: float) -> None:
    """A collective stuck on a dead peer can ignore its timeout; this bounds the whole process."""
    def fire() -> None:
        emit({"type": FrameType.ERROR, "message": f"link benchmark hung for {seconds:g} s"})
        os._exit(EXIT_HUNG)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    sys.exit(main())
