"""The probe stage: Cluster -> Inventory, every node asked concurrently (the node side is hgcli.node.probe).
"""
