"""The plan stage: Inventory + Profiles + JobSpec -> Plan. The planner's entry (``placement``) and its
steps (``devices``, ``fit``, ``kinds``, ``batches``, ``strategy``), the cost model (``cost``, with
``costed``, ``network``, ``delays``, ``pricing``, ``ps``), plan files (``files``), and probe -> bench
-> plan reusing what is stored (``pipeline``).
"""
