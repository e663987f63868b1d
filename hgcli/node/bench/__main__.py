"""``python -m hgcli.node.bench``: see main.py."""
import sys

from .main import main

sys.exit(main())
