"""What one parameter-server push costs on this node: the planner's PS exchange and PS service time.

A hybrid or ps plan's group leader pushes its gradient to the PS, the PS applies it with the
optimizer and answers with fresh parameters (hgcli/runtime/ps/server.py): the data by torch.distributed
send/recv on a gloo group of the pair (hgcli/runtime/ps/transfer.py), a control message over torch RPC
(TensorPipe, TCP, as hgcli/runtime/groups.py sets it up). With small models the fixed software cost
of that round trip (RPC, threads, the PS's locking) dominates and is far above the wire time a link
benchmark predicts, so it is measured here, the way the runtime does it, over loopback: the client
(this process, the bench) copies a model-sized gradient into its push buffer, sends it with the
control message, and loads the answer into its parameters; a child process (``--serve``) plays
the PS with SGD with momentum (torch's fused kernel, as the PS builds it), like the step
benchmark. Three
figures: the round trip of a model-sized push (``round_trip_s``), of a one-element one
(``latency_s``: the fixed cost), and the PS's own busy time per model-sized push (``service_s``:
what a PS serves serially, its capacity).

    python -m hgcli.node.bench.exchange --serve --parameters N   (started by measure_exchange)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

from ...schema.stages import ExchangeProfile
from .timing import summarize, time_repeats

CLIENT, SERVER = "bench", "ps"
_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()


def measure_exchange(torch: Any, parameters: int, *, warmup: int, repeats: int,
                     timeout_s: float = 60.0) -> ExchangeProfile:
    """Start the PS child, time pushes of ``parameters`` float32 values and of one value."""
    import torch.distributed as dist
    from torch.distributed import rpc

    from ...runtime.ps import transfer
    from ...runtime.netbind import master_store

    store = master_store("127.0.0.1", 0, 2, _delta(timeout_s), wait_for_workers=False, multi_tenant=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    child = subprocess.Popen([sys.executable, "-m", "hgcli.node.bench.exchange", "--serve", "--parameters",
                              str(parameters), "--timeout", repr(timeout_s)],
                             env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)})
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=2,
                                timeout=_delta(timeout_s))
        _init_rpc(rpc, CLIENT, 0, timeout_s)
        try:
            service: list[float] = []
            grad = torch.ones(parameters)
            staged, answer = torch.empty(parameters), torch.empty(parameters)   # the leader's buffers
            params = torch.empty(parameters)

            def push(n: int) -> None:
                staged[:n].copy_(grad[:n])
                sends = transfer.send(staged[:n], 1, None)
                fut = rpc.rpc_async(SERVER, _apply, args=(n,), timeout=timeout_s)
                transfer.wait(transfer.irecv(answer[:n], 1, None))
                service.append(fut.wait())
                transfer.wait(sends)
                params[:n].copy_(answer[:n])          # and loads the answer into its parameters

            round_trip = time_repeats(lambda: push(parameters), warmup=warmup, repeats=repeats)
            busy = service[warmup:]
            latency = time_repeats(lambda: push(1), warmup=warmup, repeats=repeats)
        finally:
            rpc.shutdown(graceful=True, timeout=timeout_s)
            dist.destroy_process_group()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return ExchangeProfile(bytes=4 * parameters, round_trip_s=summarize(round_trip),
                           latency_s=summarize(latency), service_s=summarize(busy))


def _delta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def _init_rpc(rpc: Any, name: str, rank: int, timeout_s: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="env://", rpc_timeout=timeout_s, num_worker_threads=8,
            _transports=["uv"], _channels=["basic"]))


def _apply(n: int) -> float:
    """The PS's work for one push (hgcli/runtime/ps/server.py ``push``): receive into the staging buffer,
    scale, optimizer step, send the parameters back; returns its busy time. A shorter push (the
    fixed-cost probe) is answered at once: only the messages are timed."""
    from ...runtime.ps import transfer

    start = time.perf_counter()
    with _LOCK:
        param, opt, staging = _STATE["param"], _STATE["opt"], _STATE["grad"]
        transfer.recv(staging[:n], 0, None, staging.dtype)
        if n < param.numel():
            out = staging[:n]
        else:
            staging.mul_(0.5)
            opt.step()
            out = param.detach()
        busy = time.perf_counter() - start
        transfer.wait(transfer.send(out, 0, None))
    return busy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hgcli.node.bench.exchange")
    p.add_argument("--serve", action="store_true", required=True)
    p.add_argument("--parameters", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed import rpc

    from ...runtime.ps.optim import build_fast_optimizer

    torch.set_num_threads(1)    # a PS rank's share of a node whose ranks each take a core
    param = torch.zeros(args.parameters)
    staging = torch.zeros(args.parameters)
    param.grad = staging
    opt, _ = build_fast_optimizer([param], {"module": "torch.optim", "qualname": "SGD", "defaults": {"lr": 1e-3},
                                            "groups": [{"params": [0], "options": {"lr": 1e-3, "momentum": 0.9}}]})
    _STATE.update(param=param, opt=opt, grad=staging)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, is_master=False,
                          timeout=_delta(args.timeout), multi_tenant=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=1, world_size=2,
                            timeout=_delta(args.timeout))
    _init_rpc(rpc, SERVER, 1, args.timeout)
    rpc.shutdown(graceful=True, timeout=args.timeout)    # serves until the bench shuts down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Run the imported module, not __main__: RPC resolves _apply as hgcli.node.bench.exchange._apply.
    from hgcli.node.bench.exchange import main as _main
    sys.exit(_main())
