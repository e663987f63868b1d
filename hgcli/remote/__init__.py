"""How the controller reaches nodes: the Transport protocol, SSH (``ssh`` and its
``ssh*`` modules; ``sshlib`` is the only paramiko importer), local
subprocesses, bounded fan-out, and shipping the package to a node.
"""
