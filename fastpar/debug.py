"""The debug switch: cross-rank input checks that cost one collective per call.

Every rank of a tensor-parallel group must feed its layers the same shapes (and its embedding
and loss the same token ids); when one does not, gloo aborts the process and NCCL hangs or
computes garbage. Two kinds of check guard against that:

* free checks, always on: the vocab-parallel cross-entropy carries each rank's shard width,
  ``vocab_size`` and a digest of its targets in the all-gather it does anyway, so unequal shard
  widths or targets that differ across the group raise on every rank instead of returning a
  wrong loss (at once on CPU tensors; on a GPU as an asynchronous device-side assertion, no
  host sync: the debug checks name the values there);
* debug checks, off by default: before their collectives, ``ColumnParallelLinear`` and
  ``RowParallelLinear`` (input shape and dtype), ``VocabParallelEmbedding`` (shape and a digest
  of the ids) and the cross-entropy (shape, shard width, digest of the targets, options)
  compare a summary of their input across their group (``fastpar.comm.checks.check_same``)
  and raise a ``ValueError`` on every rank naming each rank's value where they differ. Cost:
  one 16-byte all-reduce and one host sync per call (about 0.15 ms on 2 gloo ranks of a CPU),
  plus an all-gather of the summaries when they differ.

Turn the debug checks on with ``fastpar.debug_checks(True)`` for the whole process (it
overrides the variable; ``debug_checks(None)`` hands control back to it), for a block with
``with fastpar.debug_checks():``, with the trainer's ``--debug-checks``, or with the environment
variable ``FASTPAR_DEBUG_CHECKS=1`` (``0`` or unset is off). The variable is read once per
process, at the first check (and again in a forked child), not at every call
(``fastpar.switches``): after changing it in a running process, call ``refresh()``.
"""

from __future__ import annotations

from fastpar.switches import Setting, Switch

ENV_VAR = "FASTPAR_DEBUG_CHECKS"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def _parse(raw: str | None) -> bool:
    word = (raw or "").strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    raise ValueError(
        f"{ENV_VAR}={raw!r} is not 1 or 0; set {ENV_VAR}=1 to turn the cross-rank debug checks "
        "on, or unset it"
    )


def _check(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"debug_checks takes True, False or None, got {value!r}")
    return value


SWITCH = Switch(ENV_VAR, _parse, _check)


def enabled() -> bool:
    """Whether the debug checks run: ``debug_checks(...)`` if it was called, else the variable
    (read once per process)."""
    return SWITCH.get()


def refresh() -> None:
    """Read ``FASTPAR_DEBUG_CHECKS`` again at the next check (after changing ``os.environ``)."""
    SWITCH.refresh()


class debug_checks(Setting):  # lower case, like torch.autograd.set_grad_enabled
    """Turn the cross-rank debug checks on (``True``) or off (``False``) for this process, or
    hand the choice back to ``FASTPAR_DEBUG_CHECKS`` (``None``). As a context manager it
    restores the previous setting on exit::

        fastpar.debug_checks(True)          # from now on
        with fastpar.debug_checks():        # only inside the block
            loss = model(batch)
    """

    SWITCH = SWITCH

    def __init__(self, enabled: bool | None = True) -> None:
        super().__init__(enabled)
