"""A job after launch, from any terminal: job records (``records``), a recorded job's nodes (``nodes``),
``status``, ``logs``, ``stop`` and the metrics export (``export``).
"""
