"""The ``FASTPAR_*`` environment switches that change what the library does, each with an API
(``Switch``: ``get``, ``set``, ``refresh``), each variable read once per process at first use.
The API and every switch: docs/switches.md."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_UNREAD = object()
_SWITCHES: weakref.WeakSet[Switch] = weakref.WeakSet()


class Switch(Generic[T]):
    """One environment switch: ``parse(raw)`` turns the variable's text (None when unset) into
    its value, or raises ValueError; ``check(value)`` validates what the API sets."""

    def __init__(
        self, env: str, parse: Callable[[str | None], T], check: Callable[[Any], T] | None = None
    ) -> None:
        self.env, self._parse, self._check = env, parse, check or (lambda value: value)
        self._override: Any = None
        self._from_env: Any = _UNREAD
        _SWITCHES.add(self)

    def get(self) -> T:
        """The API's setting, else the variable's value (read once, then kept)."""
        if self._override is not None:
            return self._override
        value = self._from_env
        if value is _UNREAD:
            value = self._from_env = self._parse(os.environ.get(self.env))
        return value

    def set(self, value: T | None) -> _Restore:
        """Set the switch for this process (``None``: back to the variable, read again). Returns an
        object that, used as a context manager, restores the previous setting on exit."""
        restore = _Restore(self, self._override)
        if value is not None:
            value = self._check(value)
        else:
            self._from_env = _UNREAD
        self._override = value
        return restore

    def refresh(self) -> None:
        """Read the variable again at the next ``get``."""
        self._from_env = _UNREAD

    @property
    def overridden(self) -> bool:
        """Whether the API set the switch (the variable is then not consulted)."""
        return self._override is not None


class _Restore:
    def __init__(self, switch: Switch, previous: Any) -> None:
        self.switch, self.previous = switch, previous

    def __enter__(self) -> _Restore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.switch._override = self.previous
        if self.previous is None:
            self.switch._from_env = _UNREAD


class Setting:
    """The base of a switch's API call (``fastpar.debug_checks``, ``use_backend``,
    ``fastpar.moe.set_transport``): it sets ``SWITCH`` for the process when called and, used as
    a context manager, restores the previous setting on exit."""

    SWITCH: Switch

    def __init__(self, value: Any) -> None:
        self._restore = self.SWITCH.set(value)

    def __enter__(self) -> Setting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore.__exit__(*exc)


def refresh_all() -> None:
    """Read every switch's variable again at its next use (done in a forked child)."""
    for switch in list(_SWITCHES):
        switch.refresh()


def choice(env: str, words: tuple[str, ...], auto: str | None = "auto") -> Callable:
    """A parser for a variable that takes one of ``words`` (any case, spaces ignored); unset,
    empty or ``auto`` give None (the library chooses)."""

    def parse(raw: str | None) -> str | None:
        word = (raw or "").strip().lower()
        if not word or word == auto:
            return None
        if word not in words:
            allowed = "/".join(((auto,) if auto else ()) + words)
            raise ValueError(
                f"{env}={raw!r} is not one of {allowed}: set one of them, or unset {env}"
            )
        return word

    return parse


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=refresh_all)
