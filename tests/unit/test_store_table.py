"""The job's store without its process (hgcli/node/store): torch's server semantics in ``table`` (who
is woken by what, COMPARE_SET's rules, queues, barriers, the limits), the wire format's parser, the
admission rule of ``peers`` with what a real kernel says about real connections, and the peers the
launcher lists and rank 0's node resolves."""
from __future__ import annotations

import os
import socket
import struct

import pytest

from hgcli.launch.addresses import store_peers
from hgcli.node.agent.prelaunch import store_peers as prepare_peers
from hgcli.node.store import wire
from hgcli.node.store.peers import JobPeers, admit, diag_owner, judge, proc_owner
from hgcli.node.store.table import Full, Table, Unusable
from hgcli.node.store.wire import Limits, Query
from hgcli.schema.stages import Cluster, NodeSpec
from tests.launch.plans import make_plan


def test_a_wait_ends_when_its_last_key_is_written_by_set_add_or_append():
    t = Table(Limits())
    assert t.wait((b"a", b"b", b"c"), "w") is False
    assert t.set(b"a", b"1") == []            # still waits for b and c
    assert t.add(b"b", 2) == (2, [])
    assert t.append(b"c", b"x") == ["w"]      # the last one: woken once
    assert t.set(b"a", b"2") == [] and t.awaited == {} and t.waiters == {}
    assert t.wait((b"a", b"b"), "w") is True  # present keys: answered at once


def test_compare_set_writes_on_a_match_or_a_missing_key_with_empty_expected_only():
    t = Table(Limits())
    t.wait((b"k",), "w")
    assert t.compare_set(b"k", b"x", b"y") == (b"x", [])          # missing, expected given: nothing written
    assert t.check((b"k",)) is False and t.awaited == {"w": 1}      # and nobody woken for a missing key
    assert t.compare_set(b"k", b"", b"v1") == (b"v1", ["w"])
    assert t.compare_set(b"k", b"nope", b"v2") == (b"v1", [])      # no match: the current value
    assert t.compare_set(b"k", b"v1", b"v2") == (b"v2", [])
    assert t.get(b"k") == b"v2"


def test_add_keeps_decimal_text_and_refuses_what_is_not_a_number():
    t = Table(Limits())
    assert t.add(b"n", 5)[0] == 5 and t.add(b"n", -7)[0] == -2 and t.get(b"n") == b"-2"
    t.set(b"s", b"abc")
    with pytest.raises(Unusable):
        t.add(b"s", 1)
    t.set(b"big", str((1 << 63) - 1).encode())
    with pytest.raises(Unusable):
        t.add(b"big", 1)


def test_a_queue_push_wakes_one_waiter_and_pops_in_order():
    t = Table(Limits())
    assert t.wait((b"q",), "a") is False and t.wait((b"q",), "b") is False
    assert t.queue_push(b"q", b"1") == ["a"]
    assert t.check((b"q",)) is True and t.queue_len(b"q") == 1
    assert t.queue_push(b"q", b"2") == ["b"]
    assert t.queue_pop(b"q") == (2, b"1") and t.queue_pop(b"q") == (1, b"2") and t.queue_pop(b"q") == (0, None)
    assert t.items == 0 and t.bytes == 0


def test_a_barrier_answers_everyone_when_the_last_arrives_and_cancel_forgets_a_waiter():
    t = Table(Limits())
    assert t.barrier(b"bar", 3, "r0") == (False, [])
    assert t.barrier(b"bar", 3, "r1") == (False, [])
    assert t.barrier(b"bar", 3, "r2") == (True, ["r0", "r1"])
    t.wait((b"later",), "c")
    t.forget("c")
    assert t.set(b"later", b"x") == [] and t.awaited == {}


def test_the_limits_close_the_asking_client_and_deletes_give_room_back():
    t = Table(Limits(stored_keys=2, stored_bytes=100))
    t.set(b"a", b"1")
    t.queue_push(b"q", b"2")
    with pytest.raises(Full):
        t.set(b"b", b"3")
    t.set(b"a", b"x" * 50)                      # replacing a key is no new key
    with pytest.raises(Full):
        t.append(b"a", b"y" * 60)
    assert t.delete(b"a") == 1 and t.delete(b"a") == 0
    t.set(b"b", b"3")
    assert sorted(t.keys) == [b"b"] and t.items == 2


def test_the_parser_reads_torch_s_fields_waits_for_the_rest_and_refuses_what_torch_never_sends():
    limits = Limits(key_bytes=16, value_bytes=32, keys_per_query=4)
    frame = bytes([Query.SET]) + struct.pack("=Q", 3) + b"key" + struct.pack("=Q", 5) + b"value"
    request = wire.parse(frame + b"\x07", limits)    # the next query's first byte is left alone
    assert (request.query, request.keys, request.values, request.size) == (Query.SET, (b"key",), (b"value",), len(frame))
    with pytest.raises(wire.Incomplete) as more:
        wire.parse(frame[:21], limits)
    assert more.value.need == len(frame)            # after the value's length: its whole size
    with pytest.raises(wire.Malformed, match="unknown query type 99"):
        wire.parse(b"\x63", limits)
    with pytest.raises(wire.Malformed, match="a key of 17 bytes"):
        wire.parse(bytes([Query.GET]) + struct.pack("=Q", 17), limits)
    with pytest.raises(wire.Malformed, match="5 keys in one query"):
        wire.parse(bytes([Query.WAIT]) + struct.pack("=Q", 5), limits)
    add = wire.parse(bytes([Query.ADD]) + struct.pack("=Q", 1) + b"n" + struct.pack("=q", -3), limits)
    assert add.number == -3


def test_the_admission_rule():
    peers = JobPeers(uid=1000, addresses=("10.0.0.2",))
    assert judge("127.0.0.1", 1000, 1000, peers).admitted is True
    refused = judge("127.0.0.1", 65534, 1000, peers)
    assert (refused.admitted, refused.kind) == (False, "a process of uid 65534 on this machine")
    # A process on this machine is judged by its owner even from a job node's address.
    assert judge("10.0.0.2", 65534, 1000, peers).admitted is False
    assert judge("10.0.0.2", None, 1000, peers).admitted is True        # from node 10.0.0.2
    assert judge("10.0.0.9", None, 1000, peers).kind == "10.0.0.9, not a node of the job"
    assert judge("10.0.0.2", None, None, peers).admitted is False       # the table could not be read


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])   # torch's clients: IPv6, v4-mapped
def test_the_kernel_names_the_owner_of_a_real_connection_both_ways(family):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.socket(family) as client:
            client.connect(("127.0.0.1" if family == socket.AF_INET else "::ffff:127.0.0.1", port))
            conn, _ = listener.accept()
            with conn:
                me, peer = conn.getsockname(), conn.getpeername()
                uid = os.geteuid()
                assert proc_owner(peer, me) == uid and proc_owner(me, peer) == uid
                assert proc_owner(("127.0.0.1", 1), me) is None
                try:
                    assert diag_owner(peer, me) == uid and diag_owner(me, peer) == uid
                    # A stranger's four-tuple that matches only the listening socket's port is no connection.
                    assert diag_owner(("127.0.0.1", port), ("127.0.0.1", 9)) is None
                except OSError:
                    pytest.skip("this kernel has no sock_diag (the /proc table was checked)")
                assert admit(conn, JobPeers(uid=uid)).admitted is True
                assert admit(conn, JobPeers(uid=uid + 1)).kind == f"a process of uid {uid} on this machine"


def test_the_launcher_lists_the_other_nodes_and_a_localhost_node_beside_remote_ones():
    local = NodeSpec(name="me", host="localhost")
    far, near = NodeSpec(name="far", host="gpu7", hostname="10.0.0.7"), NodeSpec(name="near", host="10.0.0.8")
    cluster = Cluster(nodes=(local, far, near))
    assert store_peers(make_plan(cluster, [["far", "near", "far"]]), cluster) == (["10.0.0.8"], False)
    assert store_peers(make_plan(cluster, [["far", "me", "near"]]), cluster) == (["10.0.0.8"], True)
    alone = Cluster(nodes=(local,))
    assert store_peers(make_plan(alone, [["me", "me"]]), alone) == ([], False)


def test_rank_0_s_node_resolves_the_peers_and_names_one_it_cannot(monkeypatch):
    monkeypatch.setenv("SSH_CONNECTION", "192.0.2.9 50022 10.0.0.7 22")
    peers = prepare_peers(["localhost", "127.0.0.5"], True)
    assert peers.uid == os.geteuid()
    assert set(peers.addresses) >= {"127.0.0.1", "127.0.0.5", "192.0.2.9"}
    assert "192.0.2.9" not in prepare_peers(["127.0.0.5"], False).addresses
    with pytest.raises(ValueError, match="cannot resolve the job's node 'no-such-node.invalid' on this node"):
        prepare_peers(["no-such-node.invalid"], False)
    with pytest.raises(ValueError, match="peers must be a list of host names"):
        prepare_peers("10.0.0.1", False)
