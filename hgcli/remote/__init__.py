"""How the controller reaches nodes: the Transport protocol, SSH (the only paramiko importer), local
subprocesses, bounded fan-out, and shipping the package to a node.
"""
