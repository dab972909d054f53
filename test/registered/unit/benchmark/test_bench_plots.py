"""Every benchmark script that plots still finishes without matplotlib (it is in the `bench`
extra, not the main install): its plot goes through sglang.bench_plot.import_pyplot, which says
how to get matplotlib and writes nothing."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[4] / "benchmark"
_PLOTTING = sorted(str(p.relative_to(_ROOT)) for p in _ROOT.rglob("*.py") if "def plot(" in p.read_text())


def test_no_benchmark_imports_matplotlib_itself():
    """A direct `import matplotlib` is the crash this guards against (e2e, kernels, pd, hicache did it)."""
    direct = [str(p.relative_to(_ROOT)) for p in _ROOT.rglob("*.py") if "import matplotlib" in p.read_text()]
    assert direct == []
    assert len(_PLOTTING) >= 15  # the scan sees the scripts (a moved folder would empty it)


@pytest.mark.parametrize("script", _PLOTTING)
def test_plot_without_matplotlib_is_a_clear_message(script, tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(f"_bench_{Path(script).stem}", _ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    # as `python benchmark/<script>` runs it: its folder on sys.path (pd/streaming.py), its argv
    # (kernels/bench_fused_moe.py parses at import)
    monkeypatch.setattr(sys, "path", [str((_ROOT / script).parent), *sys.path])
    monkeypatch.setattr(sys, "argv", [str(_ROOT / script)])
    spec.loader.exec_module(mod)
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    out = tmp_path / "plot.png"
    n_args = len(inspect.signature(mod.plot).parameters)
    assert mod.plot(*([{}] * (n_args - 1)), str(out)) is None  # the data is never read
    assert "pip install -e './python[bench]'" in capsys.readouterr().err
    assert not out.exists()
