"""Triton kernels and their launchers, installed as ``fastpar.kernels``.

Nothing here is imported by ``import fastpar``: the ops in ``fastpar.ops`` import a kernel
module only when they dispatch to Triton, so fastpar works on machines without Triton.
"""
