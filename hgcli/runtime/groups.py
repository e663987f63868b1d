"""Process groups and RPC for one job, created identically on every rank (workers and PS).

Every rank joins the default gloo group (the final barrier), then every rank calls ``new_group``
for every all-reduce group of the plan in plan order, as torch requires. A group whose ranks are all
real GPUs uses NCCL; otherwise gloo. With parameter-server ranks, each group leader and each PS
shard also share a pair group of their own (gloo: the PS's tensors are CPU tensors) for the bulk
data of pushes and answers (ps/transfer.py), and RPC carries the control messages. RPC uses
TensorPipe's TCP transport only: its shared-memory transport failed with spurious EOFs on a busy
machine. Every collective and RPC gets the job's timeout.

Every listener binds to one address, and every key lives under the job's secret prefix
(``netbind``): the store on MASTER_ADDR, gloo/NCCL/TensorPipe on this node's cluster address.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import warnings

import torch.distributed as dist

from ..schema import stages as model
from . import netbind
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


def _node(env: RankEnv) -> str:
    """This rank's node: the plan's name for it, else the host name (a plain torchrun environment)."""
    return env.plan.rank(env.rank).node if env.plan else socket.gethostname()


def _after(start: float, env: RankEnv) -> str:
    """How long a step really waited, beside its limit: a step that failed at once must not read as
    a timeout ("after 0.2 s (limit 120 s, HGTRAIN_TIMEOUT)")."""
    return f"after {time.monotonic() - start:.1f} s (limit {env.timeout_s:g} s, HGTRAIN_TIMEOUT)"


def check_rpc_needs(env: RankEnv) -> None:
    """RPC's TensorPipe set-up gathers objects with ``dist.all_gather_object``, which converts tensors
    with ``tensor.numpy()``; the torch wheel does not depend on numpy, so without it ``init_rpc``
    failed with torch's bare "Numpy is not available". Checked before the rendezvous, so the rank
    says what is missing, where, and how to install it, and fails at once."""
    import torch

    try:
        import numpy
    except ImportError as exc:
        why = f"numpy cannot be imported ({exc})"
    else:
        try:
            torch.zeros(1).numpy()
            return
        except RuntimeError as exc:
            why = f"torch {torch.__version__} cannot use numpy {numpy.__version__} ({exc})"
    node = _node(env)
    raise TrainingError(f"rank {env.rank} (node {node}): torch.distributed.rpc, which the parameter-server "
                        f"ranks use, needs numpy, and in {sys.executable} {why}: run "
                        f"'{sys.executable} -m pip install numpy' on node {node}")


def open_store(env: RankEnv, addr: str, port: int, timeout: datetime.timedelta) -> dist.Store:
    """Under ``hgtrain launch`` (and torchrun) the agent serves the store
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and every rank is a client; otherwise rank 0 hosts it on
    ``addr`` only: it binds the listening socket itself and gives it to torch (TCPStore would bind
    every interface). The job's keys sit under its token's prefix, apart from any other job's; only
    the agent's store keeps strangers out (torch's lists every key: netbind's docstring)."""
    if env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        base = netbind.master_store(addr, port, env.world_size, timeout, wait_for_workers=False,
                                    multi_tenant=True)
    else:
        base = dist.TCPStore(addr, port, env.world_size, is_master=False, timeout=timeout, multi_tenant=True)
    prefix = netbind.key_prefix(os.environ.get(netbind.TOKEN, ""))
    return dist.PrefixStore(prefix, base) if prefix else base


def join(env: RankEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous, done so that a rank that never joins is *named* after the timeout (torch's own
    only counts clients: "1/2 clients joined"). The store is at MASTER_ADDR:MASTER_PORT (the agent's,
    or rank 0's, multi-tenant, so RPC's rendezvous shares it); every rank checks in under its own key and
    waits for all the others' keys."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    start = time.monotonic()
    try:
        store = open_store(env, addr, port, timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        what = (f"cannot open the rendezvous at {addr}:{port}" if env.rank == 0 else
                f"{_who(env, [0])} did not open the rendezvous at {addr}:{port}")
        raise TrainingError(f"rank {env.rank}: cannot join the job: {what}: failed {_after(start, env)}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from exc
    store.set(f"{JOINED}{env.rank}", "1")
    waiting = time.monotonic()
    missing = [r for r in range(env.world_size) if r != env.rank]
    base = getattr(store, "underlying_store", store)
    prefix = netbind.key_prefix(os.environ.get(netbind.TOKEN, ""))
    while True:
        try:
            foreign = prefix != "" and _foreign_keys(base, prefix)
            missing = [r for r in missing if not store.check([f"{JOINED}{r}"])]
            if missing and foreign:
                raise TrainingError(_not_hg_init(env, missing))
        except RuntimeError:
            # Rank 0 gave up on the same missing ranks a moment earlier and closed the store: say what
            # this rank was waiting for, not torch's "Failed to recv" (the root cause is the same).
            raise TrainingError(f"rank {env.rank}: {len(missing)} of {env.world_size} ranks never joined "
                                f"the job: gave up {_after(waiting, env)} when {_who(env, [0])} closed the "
                                f"rendezvous: {_who(env, missing)}") from None
        if not missing:
            return store
        if time.monotonic() > waiting + env.timeout_s:
            raise TrainingError(f"rank {env.rank}: {len(missing)} of {env.world_size} ranks never joined "
                                f"the job: gave up {_after(waiting, env)}: {_who(env, missing)}")
        time.sleep(0.05)


# Keys no job writes: TCPStore's "init/" counter, which every client's connection adds to.
STORE_OWN_KEYS = frozenset({"init/"})


def _foreign_keys(base: dist.Store, prefix: str) -> bool:
    """Whether the store holds a key outside the job's prefix: under ``hgtrain launch`` (a job token,
    the agent's store of this job alone) only a plain ``init_process_group`` writes one while ranks
    are still joining. Read before the joined keys are checked: a rank leaves ``join`` only once every
    rank has joined, so a key its later steps write outside the prefix (RPC's rendezvous) exists only
    when the check that follows finds nobody missing. Never under plain torchrun (no token): its
    agent's store holds torchrun's own rendezvous keys."""
    return any(k not in STORE_OWN_KEYS and not k.startswith(prefix) for k in base.list_keys())


def _not_hg_init(env: RankEnv, missing: list[int]) -> str:
    """The job's store holds keys that no rank of hgtrain wrote while ``missing`` have not joined:
    they are in a plain ``init_process_group`` (a script that never calls ``hg.init()``), whose
    WORLD_SIZE counts ranks (the parameter servers) that never join it. Said at once: the wait
    would end only at the timeout, naming every rank but the cause."""
    kind = "hybrid or ps" if env.plan is None else env.plan.strategy.value
    return (f"rank {env.rank}: {_who(env, missing)} joined a plain torch.distributed rendezvous instead of "
            f"calling hg.init(), which a {kind} plan's workers must: port the script (docs/runtime.md, "
            f"\"Porting a DDP script\") or launch it with --strategy allreduce")


def init_distributed(env: RankEnv, plan: model.Plan) -> dict[int, dist.ProcessGroup]:
    """Join the job; returns {group id: process group} for the group(s) this rank belongs to."""
    timeout = datetime.timedelta(seconds=env.timeout_s)
    if plan.ps_shards:
        check_rpc_needs(env)
    try:
        netbind.pin_interfaces()
    except ValueError as exc:
        raise TrainingError(f"rank {env.rank} (node {_node(env)}): {exc}") from None
    store = join(env, timeout)
    step, start = "the default process group (gloo)", time.monotonic()
    try:
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        mine = {}
        for g in plan.groups:
            step, start = f"all-reduce group {g.id} ({group_backend(plan, g)})", time.monotonic()
            pg = dist.new_group(list(g.ranks), timeout=timeout, backend=group_backend(plan, g))
            if env.rank in g.ranks:
                mine[g.id] = pg
        for g in plan.groups:
            # One pair group per (group leader, PS shard): the bulk data of pushes and answers
            # (ps/transfer.py). Gloo: the PS's tensors are CPU tensors.
            for s, ps_rank in enumerate(plan.ps_shards):
                step, start = f"the data channel of group {g.id} and PS shard {s}", time.monotonic()
                pair = dist.new_group([g.ranks[0], ps_rank], timeout=timeout, backend="gloo")
                if env.rank in (g.ranks[0], ps_rank):
                    _CHANNELS[(g.id, s)] = pair
        if plan.ps_shards:
            from torch.distributed import rpc

            step, start = "RPC (TensorPipe) for the parameter servers", time.monotonic()
            with warnings.catch_warnings():
                # torch's own rpc init trips its "Backend used as a ProcessGroup" deprecation warning.
                warnings.simplefilter("ignore", UserWarning)
                rpc.init_rpc(rpc_name(env.rank), rank=env.rank, world_size=env.world_size,
                             rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                                 init_method=_rpc_rendezvous(store), rpc_timeout=env.timeout_s,
                                 num_worker_threads=8, _transports=["uv"], _channels=["basic"]))
    except (RuntimeError, ValueError) as exc:
        raise TrainingError(f"rank {env.rank}: cannot set up {step} of the job (rendezvous at MASTER_ADDR/"
                            f"MASTER_PORT): failed {_after(start, env)}: {exc}") from exc
    return mine


_RPC_STORES: dict[str, dist.Store] = {}
_CHANNELS: dict[tuple[int, int], dist.ProcessGroup] = {}


def channel(group_id: int, shard: int) -> dist.ProcessGroup:
    """The process group of group ``group_id``'s leader and PS shard ``shard`` (on those two ranks)."""
    try:
        return _CHANNELS[(group_id, shard)]
    except KeyError:
        raise TrainingError(f"no data channel between group {group_id} and PS shard {shard} on this "
                            f"rank (only the group's leader and the shard have one)") from None


def _rpc_rendezvous(store: dist.Store) -> str:
    """An init_method for RPC that hands it the job's (prefixed) store: "env://" would open a second,
    unprefixed connection to the store, outside the job's key space."""
    if "hgtrain" not in _RPC_STORES:
        dist.register_rendezvous_handler("hgtrain", _rpc_handler)
    _RPC_STORES["hgtrain"] = store
    return "hgtrain://"


def _rpc_handler(url: str, **kwargs: object):  # type: ignore[no-untyped-def]
    from urllib.parse import parse_qs, urlparse

    query = parse_qs(urlparse(url).query)
    yield _RPC_STORES["hgtrain"], int(query["rank"][0]), int(query["world_size"][0])


def shutdown(plan: model.Plan, timeout_s: float) -> None:
    """Leave the job together: a barrier (so no RPC is in flight), then RPC and process groups."""
    if not dist.is_initialized():
        return
    dist.barrier()
    if plan.ps_shards:
        from torch.distributed import rpc

        rpc.shutdown(graceful=True, timeout=timeout_s)
    _CHANNELS.clear()
    dist.destroy_process_group()
