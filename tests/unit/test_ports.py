"""hgcli.node.ports: MASTER_PORT is picked below the kernel's ephemeral range (CI saw EADDRINUSE when an
outgoing connection took a port picked with bind(0) before rank 0 bound it)."""
import socket

from hgcli.node import ports


def test_port_is_below_the_ephemeral_range_and_free():
    low = ports._ephemeral_low()
    assert low is not None, "this test needs /proc/sys/net/ipv4/ip_local_port_range"
    seen = set()
    for _ in range(20):
        port = ports.free_port()
        assert ports.FLOOR <= port < low
        with socket.socket() as s:      # free: binding it on every address works
            s.bind(("", port))
        seen.add(port)
    assert len(seen) > 1, "ports are random, so two jobs starting together do not pick the same one"


def test_a_bound_port_is_never_picked(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    # Only the held port and its successor are candidates: the picker must skip the held one.
    monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: taken)
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 2000)
    monkeypatch.setattr(ports, "FLOOR", taken)
    try:
        port = ports.free_port()
        assert port != taken        # every try hit the held port, so the kernel picked one
    finally:
        held.close()


def test_without_a_known_range_the_kernel_picks(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "RANGE_FILE", str(tmp_path / "missing"))
    port = ports.free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
