"""Memory a process holds, from /proc: how the engine measures each model's worker."""
from __future__ import annotations

from pathlib import Path


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes; 0 when the process is gone (or /proc is unavailable)."""
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return 0
    return 0
