"""Picking a TCP port for a server that another process will bind a moment later (MASTER_PORT).

Binding port 0 and closing the socket hands out a port from the kernel's ephemeral range, and the
same range feeds every outgoing connection on the machine: in the second or two before rank 0's
TCPStore binds it, a gloo pair or an SSH client can take it (seen in CI as EADDRINUSE on a busy
machine). Ports below the ephemeral range are never handed out implicitly, so a port picked there
stays free unless some process asks for that very number. A random one, so two jobs starting at the
same moment do not race for the same number; checked free by binding it on every address.
"""
from __future__ import annotations

import random
import socket

FLOOR = 20000               # below: registered service ports (databases, exporters) are common
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
TRIES = 64


def _ephemeral_low() -> int | None:
    try:
        with open(RANGE_FILE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "") -> int:
    """A port nothing is bound to on ``host`` ("" = every address), outside the ephemeral range when
    the kernel says where that is; otherwise (or when none is free there) one the kernel picks."""
    low = _ephemeral_low()
    if low is not None and low - FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(TRIES):
            port = rng.randrange(FLOOR, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
