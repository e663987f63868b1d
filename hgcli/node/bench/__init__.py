"""The node side of ``hgtrain bench`` (``python -m hgcli.node.bench``): micro-benchmarks, training-step
times, the PS exchange, the synchronous group step, a node's devices stepping together, and links
between two nodes. torch is imported lazily.
"""
