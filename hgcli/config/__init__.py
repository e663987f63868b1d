"""Where the nodes come from: the cluster file (``cluster``), DeepSpeed/MPI hostfiles and Slurm node lists
(``nodelists``), TOML line numbers for errors (``tomllines``), and ``--ranks`` lists (``ranklist``).
"""
