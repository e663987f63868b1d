"""``python -m hgcli.runtime.ps``: a parameter-server rank (rank.py), started by the launcher."""
import os
import sys

from hgcli.runtime.ps.rank import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # do not wait on RPC threads of a failed job
