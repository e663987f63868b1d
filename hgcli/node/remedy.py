"""What to do about a module that a node's Python lacks, in the words shown to the user: by the
planner, from the node probe's findings (``plan/pipeline.py``), and by the node's bench when it finds
the module missing itself (``node/bench/main.py``). Which modules a plan needs is the contract
(``schema.stages.PLAN_NEEDS``); the advice lives here, beside the node code that reports it.
"""
from __future__ import annotations

# What to do about a missing module ({py}: the node's Python, {node}: its name): said by the planner
# from the probe and by a node program that finds the module missing itself.
MODULE_REMEDY = {
    "torch": "lacks torch: run '{py} -m pip install torch' on {node}",
    "gloo": "has a torch without torch.distributed's gloo backend: install a torch build with it",
    "rpc": "has a torch without torch.distributed.rpc (TensorPipe), which parameter-server ranks use: "
           "install a torch build with it",
    "numpy": "lacks numpy, which torch.distributed.rpc needs for the parameter-server ranks: run "
             "'{py} -m pip install numpy' on {node}",
}
OR_ANOTHER_PYTHON = "; or set the node's python in the cluster file to one that has it"


def module_problem(module: str, python: str, node: str, why: str | None = None) -> str:
    """"its Python P lacks M: run ... on N (why)": what the node's Python lacks and what to do."""
    return (f"its Python {python} " + MODULE_REMEDY[module].format(py=python, node=node)
            + (f" ({why})" if why else ""))
