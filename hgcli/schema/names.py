"""The one pattern for node names and job ids, checked by the controller and by the node agent; and
the host names the controller accepts (cluster files, hostfiles, Slurm lists, ssh_config).

Both become directory names on a node (``<jobs root>/<job id>/<node>``) and arguments of the agent:
letters, digits, '.', '_', '-', not starting with '.' or '-' (never a path, a hidden file or an option).
The controller checks names when it loads a cluster file and job ids when they come from the command
line, so a bad one fails there, naming the file and line, not later on a node.
"""
from __future__ import annotations

import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RULE = "letters, digits, '.', '_', '-', starting with a letter or digit, at most 128 characters"


def valid_name(value: str) -> bool:
    return bool(NAME.fullmatch(value))


def check_name(kind: str, value: str) -> str:
    """``value``; ValueError naming ``kind`` when it breaks the pattern."""
    if not valid_name(value):
        raise ValueError(f"{kind} {value!r} is not a valid name ({RULE})")
    return value


# Host names as ssh, DNS and Slurm accept them, plus IPv6 literals; no leading "-" (never an option).
HOST = re.compile(r"[A-Za-z0-9_.:%][A-Za-z0-9_.:%-]*")


def valid_host(host: str) -> bool:
    return bool(HOST.fullmatch(host))        # not match(...$): "$" also matches before a final newline
