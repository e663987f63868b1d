"""A job after launch, from any terminal: a recorded job's nodes (``nodes``), ``status``, ``logs``,
``stop``, the metrics export (``export``) and the picture of a run (``report``). The job records are
``state/records.py``; the metrics as series and TensorBoard files are ``launch/``'s.
"""
