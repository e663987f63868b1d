"""Inventories for bench tests, written the way the probe describes a node (hgcli.schema.stages.NodeInfo).

The probe module lands from another branch; until then the bench tests state the inventory they
bench, which is also what keeps them independent of nvidia-smi and of this machine's hardware.
"""
from __future__ import annotations

import torch

from hgcli.schema.stages import Cluster, GpuInfo, Inventory, NodeInfo, to_dict
from hgcli.state import cluster_dir, write_json


def inventory_of(cluster: Cluster) -> Inventory:
    """Every node reachable; emulated nodes get their declared GPUs, the others none (a CPU)."""
    nodes = []
    for node in cluster.nodes:
        gpus = ()
        if node.emulate is not None:
            e = node.emulate
            gpus = tuple(GpuInfo(index=i, name=name, memory_total_mib=mem, emulated=True, speed=speed)
                         for i, (name, speed, mem) in enumerate(zip(e.devices, e.speed, e.memory_mib)))
        nodes.append(NodeInfo(name=node.name, host=node.host, ok=True, emulated=node.emulate is not None,
                              gpus=gpus, cpu_model="test cpu", memory_total_mib=4096,
                              torch_version=torch.__version__))
    return Inventory(cluster=cluster.fingerprint(), nodes=tuple(nodes))


def store_inventory(inventory: Inventory) -> None:
    write_json(cluster_dir(inventory.cluster) / "inventory.json", to_dict(inventory))
