"""fastpar: drop-in parallel training layers for PyTorch.

Importing fastpar needs only torch: Triton and the C++ extension are probed lazily, when an op
first dispatches (see ``python -m fastpar.info``). ``fastpar.debug_checks(True)`` (or
``FASTPAR_DEBUG_CHECKS=1``) turns on the cross-rank input checks of ``fastpar.debug``.
"""

from __future__ import annotations

from fastpar.debug import debug_checks
from fastpar.mesh import ParallelMesh, init, rank_groups
from fastpar.nn.parallelize import parallelize
from fastpar.version import __version__

__all__ = ["ParallelMesh", "__version__", "debug_checks", "init", "parallelize", "rank_groups"]
