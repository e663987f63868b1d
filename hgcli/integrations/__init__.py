"""hgtrain inside the training frameworks people already use (docs/frameworks.md):
``hgcli.integrations.lightning.HgtrainStrategy``, ``hgcli.integrations.transformers.HgtrainTrainer`` and
``hgcli.integrations.accelerate.prepare``. Each module imports its framework, so this package imports
nothing: import the one your script uses."""
