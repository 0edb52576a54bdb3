"""fastpar: drop-in parallel training layers for PyTorch.

Importing fastpar needs only torch: Triton and the C++ extension are probed lazily, when an op
first dispatches (see ``python -m fastpar.info``).
"""

from __future__ import annotations

from fastpar.mesh import ParallelMesh, init, rank_groups
from fastpar.nn.parallelize import parallelize
from fastpar.version import __version__

__all__ = ["ParallelMesh", "__version__", "init", "parallelize", "rank_groups"]
