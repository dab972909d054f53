"""The benchmarks' one plotting entry point: matplotlib is in the `bench` extra, not the main
install, so a benchmark without it still writes its JSON and says how to get the plot."""

from __future__ import annotations

import sys
from types import ModuleType

INSTALL_HINT = "pip install -e './python[bench]'"


def import_pyplot(path: object) -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (after saying why `path` is not written)."""
    try:
        import matplotlib
    except ImportError:  # the JSON has every number; the plot is optional
        print(f"matplotlib is not installed, so no {path} ({INSTALL_HINT})", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
