"""The commands of ``hgtrain`` by group, each flags -> request -> one call -> render: the stage
commands (``pipeline``: probe, bench, plan), the job commands (``jobs``: status, logs, metrics, report,
stop), the options they share (``options``) and ``launch``'s own flags and console
(``launch_options``). ``hgcli/cli.py`` gathers them into the ``hgtrain`` group. Nothing here imports
torch when it loads.
"""
