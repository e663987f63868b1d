"""The probe stage: Cluster -> Inventory. Every node is asked concurrently; a failing node becomes a
``NodeInfo(ok=False, error=...)`` so the healthy ones are still reported (and cached for bench/plan).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from .. import state
from ..errors import RemoteError, StateError
from ..schema.stages import SCHEMA_VERSION, Cluster, Inventory, NodeInfo, NodeSpec, from_dict, to_dict
from ..node import frames
from ..node.protocol import FrameType, first
from ..remote.fanout import NodeResult, fanout, open_transport
from ..remote.transport import node_module_argv

# nvidia-smi on a sick node can take tens of seconds before it fails; a hung one must still end.
PROBE_TIMEOUT_S = 120.0


def probe_args(node: NodeSpec) -> list[str]:
    """The node probe's arguments for this node (visible GPU subset, declared emulation)."""
    args = ["--name", node.name, "--host", node.host]
    if node.gpus is not None:
        args += ["--gpus", ",".join(str(g) for g in node.gpus)]
    if node.emulate is not None:
        args += ["--emulate", json.dumps(to_dict(node.emulate), separators=(",", ":"))]
    return args


def parse_probe_output(node: NodeSpec, exit_code: int, stdout: str, stderr: str) -> NodeInfo:
    """The node's answer: the probe frame among whatever else a login shell printed."""
    frame = first(frames.decode_lines(stdout), FrameType.PROBE)
    if frame is not None:
        try:
            return from_dict(NodeInfo, frame.get("node"))
        except (ValueError, TypeError) as exc:
            raise RemoteError(node.name, f"the node probe answered in a form this hgtrain cannot "
                                         f"read ({exc})") from None
    last = (stderr.strip().splitlines() or ["no output"])[-1]
    raise RemoteError(node.name, f"the node probe gave no answer (exit code {exit_code}): {last}")


def probe_node(node: NodeSpec, cluster: Cluster) -> NodeInfo:
    with open_transport(node, cluster) as transport:
        argv, env = node_module_argv(transport, "probe", *probe_args(node))
        result = transport.run(argv, env=env, timeout=PROBE_TIMEOUT_S)
    return parse_probe_output(node, result.exit_code, result.stdout, result.stderr)


def _node_info(result: NodeResult[NodeInfo]) -> NodeInfo:
    node = result.node
    if result.value is None:
        return NodeInfo(name=node.name, host=node.host, ok=False, error=result.error,
                        elapsed_s=round(result.elapsed_s, 3))
    # The cluster file's names are authoritative (the node only echoes what it was given).
    return dataclasses.replace(result.value, name=node.name, host=node.host,
                               elapsed_s=round(result.elapsed_s, 3))


def probe_cluster(cluster: Cluster, on_done: Callable[[NodeInfo], None] | None = None) -> Inventory:
    """Probe every node (bounded fan-out), store the Inventory in the state directory, return it.
    ``on_done`` is called from worker threads as each node answers (progress display)."""

    def done(result: NodeResult[NodeInfo]) -> None:
        if on_done is not None:
            on_done(_node_info(result))

    results = fanout(cluster.nodes, lambda node: probe_node(node, cluster), on_done=done)
    inventory = Inventory(cluster=cluster.fingerprint(), nodes=tuple(_node_info(r) for r in results.results),
                          probed_at=time.time())
    save_inventory(inventory)
    return inventory


def inventory_path(fingerprint: str) -> Path:
    return state.cluster_dir(fingerprint) / "inventory.json"


def save_inventory(inventory: Inventory) -> None:
    state.write_json(inventory_path(inventory.cluster), to_dict(inventory))


def load_inventory(cluster: Cluster) -> Inventory | None:
    """The cached inventory of this cluster, or None when it was never probed."""
    path = inventory_path(cluster.fingerprint())
    data = state.read_json(path)
    if data is None:
        return None
    if not isinstance(data, dict) or data.get("version") != SCHEMA_VERSION:
        raise StateError(f"{path} was written by another hgtrain version; run 'hgtrain probe' again")
    try:
        return from_dict(Inventory, data)
    except ValueError as exc:
        raise StateError(f"cannot read {path}: {exc}; run 'hgtrain probe' again") from None
