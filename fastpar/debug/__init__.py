"""The debug switch: cross-rank input checks that cost one collective per call, turned on by
``fastpar.debug_checks(True)``, ``--debug-checks`` or ``FASTPAR_DEBUG_CHECKS=1``
(docs/development.md, "Cross-rank checks"). ``python -m fastpar.debug analyse DIR``: the flight
recorder's analysis of a failed run's dumps (docs/debugging.md)."""

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
