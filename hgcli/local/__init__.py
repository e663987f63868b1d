"""A test and benchmark harness, not the launcher: every rank of a plan as local subprocesses
(``python -m hgcli.local``), and hand-made plans of emulated devices (``plans``).
"""
