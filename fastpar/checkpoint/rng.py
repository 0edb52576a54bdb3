"""Random number generator states (torch CPU and CUDA, numpy's global RNG, python ``random``)
as tensors and plain values, so they load with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import random

import torch


def get_rng_state() -> dict:
    """This process's RNG states."""
    state: dict = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return state
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {
        "name": str(name),
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``get_rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        keys = s["keys"].numpy().astype("uint32")
        np.random.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["gauss"]))
