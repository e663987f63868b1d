"""``python -m hgcli.node.agent``: see main.py."""
import os
import sys

from .main import main

# os._exit: daemon threads may still be blocked writing to a dead connection; every frame has
# already been written with os.write, so there is nothing left to flush.
code = main()
sys.stdout.flush()
os._exit(code)
