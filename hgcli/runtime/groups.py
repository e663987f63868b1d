"""Process groups and RPC for one job, created identically on every rank (workers and PS).

Every rank joins the default gloo group (PS traffic and the final barrier), then every rank calls
``new_group`` for every all-reduce group of the plan in plan order, as torch requires. RPC uses
TensorPipe's TCP transport only: its shared-memory transport failed with spurious EOFs on a busy
machine, and PS tensors are CPU tensors anyway. A group whose
ranks are all real GPUs uses NCCL; otherwise gloo. RPC (TensorPipe) is started only when the plan
has parameter-server ranks. Every collective and RPC gets the job's timeout.
"""
from __future__ import annotations

import datetime
import os
import time
import warnings

import torch.distributed as dist

from ..schema import stages as model
from .env import RankEnv
from .errors import TrainingError


def rpc_name(rank: int) -> str:
    return f"rank{rank}"


def group_backend(plan: model.Plan, group: model.GroupPlan) -> str:
    ranks = [plan.rank(r) for r in group.ranks]
    if all(r.device.startswith("gpu") and not r.emulated for r in ranks):
        return "nccl"
    return "gloo"


JOINED = "hgtrain/joined/"


def _who(env: RankEnv, ranks: list[int]) -> str:
    """``rank 1 (node b), rank 3 (node c)``: nodes only where a launcher's plan names them."""
    return ", ".join(f"rank {r} (node {env.plan.rank(r).node})" if env.plan else f"rank {r}" for r in ranks)


def join(env: RankEnv, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous, done so that a rank that never joins is *named* after the timeout (torch's own
    only counts clients: "1/2 clients joined"). Rank 0 hosts the store on MASTER_ADDR:MASTER_PORT
    (multi-tenant, so RPC's env:// rendezvous shares it); every rank checks in under its own key and
    waits for all the others' keys."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    try:
        store = dist.TCPStore(addr, port, env.world_size, is_master=env.rank == 0, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as exc:
        raise TrainingError(f"rank {env.rank}: cannot join the job: {_who(env, [0])} did not open the "
                            f"rendezvous at {addr}:{port} within {env.timeout_s:g} s ({exc})") from exc
    store.set(f"{JOINED}{env.rank}", "1")
    deadline = time.monotonic() + env.timeout_s
    while True:
        missing = [r for r in range(env.world_size) if not store.check([f"{JOINED}{r}"])]
        if not missing:
            return store
        if time.monotonic() > deadline:
            raise TrainingError(f"rank {env.rank}: {len(missing)} of {env.world_size} ranks never joined "
                                f"the job within {env.timeout_s:g} s (HGTRAIN_TIMEOUT): {_who(env, missing)}")
        time.sleep(0.05)


def init_distributed(env: RankEnv, plan: model.Plan) -> dict[int, dist.ProcessGroup]:
    """Join the job; returns {group id: process group} for the group(s) this rank belongs to."""
    timeout = datetime.timedelta(seconds=env.timeout_s)
    store = join(env, timeout)
    try:
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        mine = {}
        for g in plan.groups:
            pg = dist.new_group(list(g.ranks), timeout=timeout, backend=group_backend(plan, g))
            if env.rank in g.ranks:
                mine[g.id] = pg
        if plan.ps_shards:
            from torch.distributed import rpc

            with warnings.catch_warnings():
                # torch's own rpc init trips its "Backend used as a ProcessGroup" deprecation warning.
                warnings.simplefilter("ignore", UserWarning)
                rpc.init_rpc(rpc_name(env.rank), rank=env.rank, world_size=env.world_size,
                             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                                 init_method="env://", rpc_timeout=env.timeout_s,
                                 num_worker_threads=8, _transports=["uv"], _channels=["basic"]))
    except (RuntimeError, ValueError) as exc:
        raise TrainingError(f"rank {env.rank}: cannot join the job at "
                            f"MASTER_ADDR/MASTER_PORT within {env.timeout_s:g} s: {exc}") from exc
    return mine


def shutdown(plan: model.Plan, timeout_s: float) -> None:
    """Leave the job together: a barrier (so no RPC is in flight), then RPC and process groups."""
    if not dist.is_initialized():
        return
    dist.barrier()
    if plan.ps_shards:
        from torch.distributed import rpc

        rpc.shutdown(graceful=True, timeout=timeout_s)
    dist.destroy_process_group()
