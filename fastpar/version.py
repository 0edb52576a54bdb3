"""The package version (read by setup tooling and ``python -m fastpar.info``)."""

__version__ = "0.1.0"
