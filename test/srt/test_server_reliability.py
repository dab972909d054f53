"""Regression cases from outside testing (issue 9), through real server processes: --help,
malformed bodies that used to be 500s, abandoned non-stream requests, rid reuse, max_tokens 0,
huge prompts, SIGTERM with a stream in flight, and 100+ concurrent mixed clients.
Every wait is on a condition (the server's own state), never a fixed sleep."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from sglang.srt.server_args import ServerArgs


# -- start-up ----------------------------------------------------------------------------------------
def test_help_exits_0_and_lists_every_flag():
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in r.stdout, f.name
    assert "% freq" in r.stdout and "(default: 8192)" in r.stdout  # literal % survives; defaults shown
