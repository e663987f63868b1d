"""The bench stage: Inventory -> Profiles. Devices (``cluster``), links between nodes (``links``), stored
profiles and their staleness (``profiles``), Metis profile files (``metis``). The node side is hgcli.node.bench.
"""
