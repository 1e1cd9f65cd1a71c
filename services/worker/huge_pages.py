"""Memory the worker streams every step, in an anonymous mapping with transparent huge pages asked for.

A one-row decode step reads every weight matrix once (96 MB for SmolLM2 native) and, at long contexts, tens of
MB of keys and values; none of it stays in the caches from one step to the next. With 4 KiB pages every 4 KiB of
that is a TLB miss as well. ``MADV_HUGEPAGE`` asks the kernel for 2 MiB pages for the mapping (granted where
transparent huge pages are ``always`` or ``madvise``, as on this project's machines); elsewhere the mapping has
ordinary pages and the same bytes (docs/performance.md measures it).
"""
from __future__ import annotations

import mmap

import numpy as np
import torch


def zeros(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor of ``nbytes`` in its own mapping; it lives as long as the tensor (and views)."""
    area = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # a kernel without transparent huge pages: ordinary pages
            pass
    return torch.from_numpy(np.frombuffer(area, dtype=np.uint8)[:nbytes])
