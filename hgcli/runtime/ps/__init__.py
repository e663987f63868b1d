"""The parameter-server rank (``python -m hgcli.runtime.ps``): a shard of the flat parameters, its
optimizer, the staleness rule, checkpoints, and the data path to the group leaders."""
