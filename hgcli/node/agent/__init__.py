"""The per-node agent (``python -m hgcli.node.agent``): starts one job's ranks in their own session,
forwards their output as frames, records pids, dies with its connection, and answers
``--status``/``--stop``/``--tail`` over a fresh one. Standard library only.
"""
