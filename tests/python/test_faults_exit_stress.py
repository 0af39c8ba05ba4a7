"""Process exits, normal and by error, must never abort (issue 13, item 4).

A small run of tests/python/exit_stress.py: every way of ending (normal,
shutdown, raise, sys.exit, a peer raising or killed mid-training, an error
inside backward with all-reduces in flight) once, on 2 Gloo ranks. The full
check is ``python tests/python/exit_stress.py --n 500``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

N_EXITS = 18  # 9 jobs of 2 ranks: each mode once; about a minute on 2 cores


@pytest.mark.slow
def test_exits_never_abort():
    script = Path(__file__).with_name("exit_stress.py")
    p = subprocess.run([sys.executable, str(script), "--n", str(N_EXITS), "--timeout", "120"],
                       capture_output=True, text=True, timeout=280, cwd=str(ROOT))
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert f"{N_EXITS} process exits" in summary and ": 0 aborted" in summary, summary
