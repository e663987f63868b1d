"""The plan stage: Inventory + Profiles + JobSpec -> Plan. Placement and batch sizes (``placement``), the cost
model (``cost``), plan files (``files``), and probe -> bench -> plan reusing what is stored (``pipeline``).
"""
