"""A service process ends at once after its main: with main's status, its output flushed, atexit run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

_CHILD = """
import atexit, sys
from services.common.exit import run_then_exit
atexit.register(lambda: print("atexit ran", file=sys.stderr))

def main():
    print("unflushed output", end="")
    {body}

run_then_exit(main)
"""


@pytest.mark.parametrize("body, status, said", [
    ("return None", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit(None)", 0, ""),
    ("sys.exit('bad flag: --x')", 1, "bad flag: --x"),
])
def test_the_status_of_main_with_output_and_atexit(body: str, status: int, said: str):
    out = subprocess.run([sys.executable, "-c", _CHILD.format(body=body)], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == status
    assert out.stdout == "unflushed output"
    assert "atexit ran" in out.stderr and said in out.stderr


def test_an_exception_takes_the_usual_way_out():
    out = subprocess.run([sys.executable, "-c", _CHILD.format(body="raise RuntimeError('boom')")], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "RuntimeError: boom" in out.stderr and "atexit ran" in out.stderr
