"""``hgtrain launch``: Plan -> a job of node agents. The request and attempts (``launcher``), each node's spec
(``spec``), one agent connection (``agentlink``) and its frames decoded (``inbound``), the decisions while
it runs (``loop``), events, the job record and live metrics.
"""
