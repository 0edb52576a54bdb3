"""Context parallelism: a long sequence split over the ``cp`` ranks, with ring attention
(``ring_attention``, ``ring.py``) or all-to-all attention (``all_to_all_attention``, Ulysses,
``ulysses.py``), both exact and stopping at packed documents' boundaries; the split itself
(``split_sequence``, ``local_positions``) is ``fastpar.comm.sequence``'s. The layout, the ring,
the document blocks and ``measure_waits``: docs/context.md ("Inside fastpar.parallel.context").
"""

from __future__ import annotations

from fastpar.comm.sequence import local_positions, split_sequence
from fastpar.parallel.context.ring import measure_waits, ring_attention
from fastpar.parallel.context.ulysses import all_to_all_attention

__all__ = [
    "all_to_all_attention",
    "local_positions",
    "measure_waits",
    "ring_attention",
    "split_sequence",
]
