"""A job after launch, from any terminal: job records (``records``), a recorded job's nodes (``nodes``),
``status``, ``logs``, ``stop``, the metrics export (``export``), the metrics as named series
(``series``) for TensorBoard event files (``tensorboard``) and the picture of a run (``report``).
"""
