"""paramiko, imported once for the controller: the only ``import paramiko`` in hgcli. The SSH modules
(``ssh``, ``sshconnect``, ``sshauth``, ``sshexec``, ``sshconfig``) take it from here, so its
start-up cost is paid the same cheaper way whichever of them is imported first.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types


class _Deferred(types.ModuleType):
    """Stands for a module in ``sys.modules`` until one of its attributes is used, then imports it.
    (importlib's LazyLoader does not defer here: Python 3.11's import statement reads the module's
    ``__spec__`` and so loads a lazy module at once.)"""

    def __getattr__(self, name: str) -> object:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def _defer_invoke() -> None:
    """paramiko.config imports ``invoke`` (a task runner that pulls in asyncio, yaml, unittest.mock...)
    at import time for one thing only: the ssh-config keyword ``Match exec``. That was half of
    paramiko's import and a tenth of every ``hgtrain launch``'s start-up; deferred, ``Match exec``
    still works as before (it imports invoke when it runs)."""
    if "invoke" not in sys.modules and importlib.util.find_spec("invoke") is not None:
        sys.modules["invoke"] = _Deferred("invoke")


_defer_invoke()
import paramiko as paramiko  # noqa: E402  (after _defer_invoke; re-exported)
