"""The job's rendezvous store, served by hgtrain itself: torch's TCPStore wire protocol for torch's own
clients (``wire``), its keys, queues and waiters (``table``), who may connect (``peers``: the job's own
processes, by the kernel's owner of the peer's socket or the job's node addresses) and the one-thread
server (``server``). Standard library only: the agent's store child never imports torch.
"""
