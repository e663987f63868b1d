"""The frozen dataclasses and str-Enums passed between the stages (``stages``), and their JSON
conversion (``codec``). Standard library only: shipped to nodes with the node-side code.
"""
