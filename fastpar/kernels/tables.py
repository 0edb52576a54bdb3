"""Device pointer tables of the multi-tensor kernels, cached by what built them.

A multi-tensor launch reads its tensors' data pointers (and sizes) from a table on the device.
Building, pinning and copying that table every call costs more host time than the kernel takes
at peak bandwidth, and the copy cannot be captured in a CUDA graph. ``cached_table`` keeps the
device copy per key (the pointers and sizes themselves, so a hit is right even for freed and
reallocated tensors), least recently used dropped past ``TABLE_CACHE_SIZE``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

TABLE_CACHE_SIZE = 16
"""Device tables kept per cache (a few optimizers' dtype groups, a few gradient sets)."""


def cached_table(
    cache: OrderedDict, key: tuple, build: Callable[[], tuple], device, what: str
) -> tuple:
    """``(device table, extra)`` for ``key``: from ``cache``, else ``build()`` -> (host table,
    extra) copied to ``device`` once. ``what`` names the table in the error raised when a
    first build happens during CUDA-graph capture (the copy would read a freed host buffer)."""
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    table, extra = build()
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{what} is not on the device yet; run one step before capturing a CUDA graph "
                "(later calls reuse the table and are capturable)"
            )
        table = table.pin_memory().to(device, non_blocking=True)
    else:
        table = table.to(device)
    cache[key] = (table, extra)
    while len(cache) > TABLE_CACHE_SIZE:
        cache.popitem(last=False)
    return table, extra
