"""Every benchmark script that plots still finishes without matplotlib (it is in the `bench`
extra, not the main install): the plot step says how to get it and writes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[4] / "benchmark"


@pytest.mark.parametrize("script", ["serving/bench_serving.py", "indexcache/bench_indexcache.py",
                                    "offline/bench_engine_vs_hf.py", "hicache/bench_hicache.py"])
def test_plot_without_matplotlib_is_a_clear_message(script, tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(f"_bench_{Path(script).stem}", _ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    out = tmp_path / "plot.png"
    assert mod.plot({}, str(out)) is None
    assert "pip install -e './python[bench]'" in capsys.readouterr().err
    assert not out.exists()
