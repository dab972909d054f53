"""The package version (upstream keeps it in sglang/version.py): a leaf, so any module can read it."""

__version__ = "0.1.0"
