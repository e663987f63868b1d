"""``hgtrain launch``: Plan -> a job of node agents. The request and attempts (``launcher``), each node's spec
(``spec``), one agent connection (``agentlink``), the decisions while it runs (``loop``), events and the
console thread (``events``, ``dispatch``), the job record and live metrics, and the metrics as series and
TensorBoard files (``series``, ``tensorboard``).
"""
