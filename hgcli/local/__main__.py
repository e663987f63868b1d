"""``python -m hgcli.local``: see run.py."""
import sys

from .run import main

sys.exit(main())
