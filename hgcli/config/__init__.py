"""Where the nodes come from: the node source -> Cluster (``cluster``), reading a cluster file or hostfile
(``clusterfile``) with file:LINE checks of its values (``checks``), DeepSpeed/MPI hostfiles and Slurm node
lists (``nodelists``), TOML line numbers for errors (``tomllines``), and ``--ranks`` lists (``ranklist``).
"""
