"""``hgtrain launch``: Plan -> a job of node agents. The request (``request``), the launch and its
attempts (``launcher``, ``attempt``; how an attempt ends and what follows it: ``ending``), each node's spec
(``spec``, ``addresses``), one agent connection (``agentlink``) and its frames decoded (``inbound``), one
attempt's controller (``loop``: ``frame_handlers``, ``liveness``, ``stopping``), re-grouping and
``--nnodes`` (``adapt``, ``elastic``), events and the console thread (``events``, ``dispatch``), the job
record and live metrics, and the metrics as series and TensorBoard files (``series``, ``tensorboard``).
"""
