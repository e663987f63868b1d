"""The frozen dataclasses and str-Enums passed between the stages (``stages``, which re-exports them
from one module per stage: ``cluster``, ``inventory``, ``profiles``, ``plan``, ``job``, on ``base``), and
their JSON conversion (``codec``). Standard library only: shipped to nodes with the node-side code.
"""
