"""Ops: autograd Functions and their functional API; each picks Triton, the extension or the
pure-torch reference through ``fastpar.ops.backend.select``."""
