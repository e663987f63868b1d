"""hgtrain: heterogeneous-cluster training launcher (package ``hgcli``)."""

__version__ = "0.1.0"
