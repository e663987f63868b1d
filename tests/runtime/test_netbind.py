"""Where a job's listeners bind and who may use its rendezvous (docs/security.md).

A real local job (store, gloo, RPC) is checked with ``ss``; the store's secret prefix with a real
TCPStore and a foreign client that does not know the job's token."""
import datetime
import os
import socket

import pytest
import torch.distributed as dist

from hgcli.local.plans import emulated_plan
from hgcli.node.ports import free_port
from hgcli.runtime import netbind
from hgcli.runtime.env import RankEnv
from hgcli.runtime.groups import JOINED, open_store
from hgcli.schema.stages import Role

from .helpers import run_ok, script


def test_a_local_job_listens_on_loopback_only(tmp_path):
    """Rank 0's store listened on every interface (``*:PORT``) whatever MASTER_ADDR said."""
    plan = emulated_plan([[1.0]], [[4]], n_ps=1)          # a PS: RPC's TensorPipe listener too
    argv = script("listeners.py", tmp_path)
    run_ok(plan, argv, tmp_path, ps_argv=argv, timeout_s=120)
    for rank in (0, 1):
        listening = (tmp_path / f"listen{rank}.txt").read_text().split()
        assert listening, f"rank {rank} listens nowhere?"
        # rank 0: store + gloo + TensorPipe; rank 1: gloo + TensorPipe
        assert len(listening) >= (3 if rank == 0 else 2), listening
        assert all(a.rsplit(":", 1)[0] == "127.0.0.1" for a in listening), (rank, listening)
        assert (tmp_path / f"sum{rank}.txt").read_text() == "2"     # and the job still works


def _env(rank: int) -> RankEnv:
    return RankEnv(rank=rank, world_size=2, local_rank=rank, local_world_size=2, role=Role.WORKER,
                   group=None, batch_size=None, speed=1.0, job_id="j", metrics_fd=None, timeout_s=5.0,
                   plan=None)


    return Role.WORKER


def test_a_client_without_the_token_neither_sees_the_job_nor_fakes_a_rank(monkeypatch):
    """A separate process used to read ``hgtrain/joined/0`` and could write the job's keys."""
    port = free_port()
    monkeypatch.setenv(netbind.TOKEN, netbind.new_token())
    timeout = datetime.timedelta(seconds=5)
    store = open_store(_env(0), "127.0.0.1", port, timeout)
    store.set(f"{JOINED}0", "1")
    foreign = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
    assert not foreign.check([f"{JOINED}0"]), "a client without the token sees who joined"
    foreign.set(f"{JOINED}1", "1")               # pretends rank 1 joined
    foreign.set("joined/1", "1")
    assert not store.check([f"{JOINED}1"]) and not store.check(["joined/1"])
    # The real rank 1, with the token, is seen.
    peer = open_store(_env(1), "127.0.0.1", port, timeout)
    peer.set(f"{JOINED}1", "1")
    assert store.check([f"{JOINED}1"]) and peer.check([f"{JOINED}0"])


def test_the_store_binds_master_addr_and_says_so_when_it_cannot():
    port = free_port()
    sock = netbind.listen_on("127.0.0.1", port)
    try:
        assert sock.getsockname() == ("127.0.0.1", port)
    finally:
        sock.close()
    with pytest.raises(OSError):             # TEST-NET-2: held by no interface here
        netbind.listen_on("198.51.100.7", port)


def test_gloo_tensorpipe_and_nccl_are_pinned_to_the_interface_of_the_bind_address():
    lo = socket.if_indextoname(1)            # the loopback interface is index 1 on Linux
    env = {netbind.BIND_ADDR: "127.0.0.2"}   # an emulated node's address, inside lo's 127.0.0.1/8
    assert netbind.pin_interfaces(env) == lo
    assert all(env[v] == lo for v in netbind.IFNAME_VARS)
    mine = {netbind.BIND_ADDR: "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth7"}
    netbind.pin_interfaces(mine)
    assert mine["GLOO_SOCKET_IFNAME"] == "eth7" and mine["TP_SOCKET_IFNAME"] == lo   # the user's wins
    with pytest.raises(ValueError, match="198.51.100.7: no network interface"):
        netbind.pin_interfaces({netbind.BIND_ADDR: "198.51.100.7"})
    assert netbind.pin_interfaces({}) is None and os.environ.get(netbind.BIND_ADDR) is None
