"""A service's process ends as soon as its ``main`` has returned: no teardown of its imported modules.

When a service has drained and closed what it owns (calls finished, workers stopped, the catalog
left), the interpreter's own shutdown is still to come: it clears every imported module and
collects them. With torch and transformers imported that took 2-4 s per process on the 2-core
machine, and it is on the stop path of everything: an engine waits for the worker of a model it
unloads (or restarts), a stack stops its router and engines one after another, ``make up`` and the
tests wait for each. ``run_then_exit(main)`` runs ``main`` and then exits with its status at once:
atexit handlers still run (logging's flush among them) and the standard streams are flushed; only
the module teardown is skipped. An exception other than ``SystemExit`` takes Python's usual way
out (its traceback printed).
"""
from __future__ import annotations

import atexit
import os
import sys
from typing import Callable, NoReturn


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = _status(exc.code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader is gone
            pass
    os._exit(code)


def _status(code: object) -> int:
    """What ``sys.exit(code)`` exits with: None is 0, an int is itself, anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
