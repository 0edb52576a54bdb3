"""Data parallelism: one family over flat shards (``fastpar.parallel`` re-exports its names).

``Replicate`` (stage 0), ``Shard`` (ZeRO 1, 2, 3) and ``DistributedDataParallel`` in
``replicate.py`` / ``ddp.py``, the behaviour they share in ``family.py``, over ``FlatShard``
(``flat.py``) and the buckets that overlap the gradient collectives with backward
(``buckets.py``); ``layout.py`` lays the parameters out in flats, ``units.py`` holds the ZeRO-3
units, ``state.py`` the optimizer state's pieces, ``protocols.py`` the ``DataParallel`` and
``GradSync`` protocols.
"""

from __future__ import annotations

from fastpar.parallel.data.ddp import DistributedDataParallel
from fastpar.parallel.data.flat import FlatShard
from fastpar.parallel.data.protocols import DataParallel, GradSync
from fastpar.parallel.data.replicate import Replicate, Shard

__all__ = ["DataParallel", "DistributedDataParallel", "FlatShard", "GradSync", "Replicate", "Shard"]
