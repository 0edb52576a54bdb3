"""The argument parser every ``python -m fastpar.*`` command uses (``Parser``): no prefix
matching (``--step 5`` is an error, never ``--steps``), and a bad command line ends with ONE
line, ``error: ...``, and exit code 2 instead of argparse's usage block; an unknown flag names
the nearest one (``error: unrecognized argument --microbatch; did you mean --microbatches?``)."""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import math
import sys
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any


def nearest_flag(arg: str, options: list[str]) -> str | None:
    """The option string of ``options`` closest to ``arg`` (its ``=value`` ignored), or None."""
    name = arg.split("=", 1)[0]
    near = difflib.get_close_matches(
        name, [o for o in options if o.startswith("--")], n=1, cutoff=0.6
    )
    return near[0] if near else None


def os_error_text(e: OSError) -> str:
    """An ``OSError`` in words: 'No space left on device (ENOSPC)'."""
    name = errno.errorcode.get(e.errno or 0)
    return f"{e.strerror or e} ({name})" if name else str(e)


def read_table(path: str, flag: str, holds: str = "settings") -> dict:
    """The top-level table of the .toml (tomllib; tomli on Python 3.10) or .json file a command
    line's ``flag`` names; ValueError naming the flag, the file and the fix (``holds``: what the
    table maps, for the message when the file holds something else)."""
    kind = "toml" if path.endswith(".toml") else "json" if path.endswith(".json") else None
    if kind is None:
        raise ValueError(f"{flag} {path}: name a .toml or a .json file")
    try:
        if kind == "json":
            with open(path) as f:
                raw = json.load(f)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            with open(path, "rb") as f:
                raw = tomllib.load(f)
    except OSError as exc:
        raise ValueError(
            f"{flag} {path}: cannot read it as {kind.upper()} ({exc.strerror or exc})"
        ) from exc
    except ValueError as exc:  # JSONDecodeError, TOMLDecodeError
        raise ValueError(
            f"{flag} {path}: cannot read it as {kind.upper()} (not valid {kind.upper()}: {exc})"
        ) from exc
    if not isinstance(raw, dict):
        got = type(raw).__name__
        raise ValueError(
            f"{flag} {path}: the file must hold a table of {holds}, not a{'n' * (got[0] in 'aeiou')} {got}"
        )
    return raw


def unknown_text(unknown: list[str], options: list[str], prog: str) -> str:
    """The one line for arguments no flag takes: the first one, with its nearest flag."""
    first, flags = unknown[0], [a for a in unknown[1:] if a.startswith("-")]
    more = f" (and {len(flags)} more)" if flags else ""
    if not first.startswith("-"):
        return f"unrecognized argument {first!r}{more}: {prog} takes no such value (see --help)"
    near = nearest_flag(first, options)
    hint = f"did you mean {near}?" if near else f"see {prog} --help"
    return f"unrecognized argument {first.split('=', 1)[0]}{more}; {hint}"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and one-line errors (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def option_strings(self) -> list[str]:
        """Every flag of this parser and of its sub-commands' parsers."""
        out = []
        for action in self._actions:
            out += action.option_strings
            choices = getattr(action, "choices", None)
            for sub in choices.values() if isinstance(choices, dict) else ():
                if isinstance(sub, argparse.ArgumentParser):
                    out += [s for a in sub._actions for s in a.option_strings]
        return list(dict.fromkeys(out))

    def parse_args(self, args=None, namespace=None):
        self._argv = sys.argv[1:] if args is None else list(args)
        ns, unknown = self.parse_known_args(self._argv, namespace)
        if unknown:
            self.exit(2, f"error: {unknown_text(unknown, self.option_strings(), self.prog)}\n")
        return ns

    def error(self, message: str):
        """One line (no usage block), exit code 2; a required flag missing beside an unknown
        one (``--vocab 300`` for ``--vocab-size 300``) names the unknown one and its nearest."""
        options = self.option_strings()
        unknown = [
            a
            for a in getattr(self, "_argv", [])
            if a.startswith("--") and a.split("=", 1)[0] not in options
        ]
        if unknown and "required" in message:
            self.exit(2, f"error: {unknown_text(unknown, options, self.prog)}\n")
        text = message.replace("\n", " ")
        self.exit(2, f"error: {text} (see {self.prog} --help)\n")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            sys.stderr.write(message)
        sys.exit(status)


# -- options declared on dataclass fields -------------------------------------------------------
OPTION = "fastpar.option"
"""The ``dataclasses.field`` metadata key under which ``option`` keeps a field's ``Option``."""


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()
"""``Option.flag_default`` when the flag's default is the field's."""


@dataclass(frozen=True)
class Option:
    """A dataclass field's command-line flag, kept in the field's metadata (``option``)."""

    help: str | Callable[[], str]
    """The flag's --help text ("(default X)" is added where the default is not None); a
    callable is called when asked (``text``), so a registry it lists counts what is added later."""
    group: str | None = None
    """The --help section the flag is listed under (None: the parser's own options)."""
    metavar: str | None = None
    """The value's placeholder in --help (``words`` are shown instead when given)."""
    words: Iterable = ()
    """The values the flag takes, shown as its metavar; the config's check names a bad one. A
    registry (a dict: its keys) is read when asked, so what is added to it later counts."""
    name: str | None = None
    """The flat name (the flag ``--<name>``, its --config / train_config.json key) when it is
    not the field's own name (``num_experts`` is ``--experts``)."""
    inverted: bool = False
    """The flag is the field's negation (``--untied`` is ``not tie_embeddings``)."""
    zero_is_none: bool = False
    """The flag's 0 is the field's None (``--q-lora-rank 0``: no low-rank query)."""
    flag_default: Any = FIELD_DEFAULT
    """The flag's default where it is not the field's (as the flag says it: the trainer ties
    a model's head, a ``LlamaConfig`` alone does not)."""
    deferred: bool = False
    """The flag's default is None, not the field's: left out, the value follows other flags
    (resolved when the config is made from the flags)."""
    resume: str = ""
    """Resuming a checkpoint with another value: "refuse" (the value defines the model),
    "warn" (the checkpoint fits but the run leaves its trajectory), "" (free: the layout)."""
    at_least: float | None = None
    """The bound: the least value (a float must also be finite); None: no lower bound."""
    at_most: float | None = None
    """The bound: the largest value ("--x 9 exceeds 8"); None: no upper bound."""
    positive: bool = False
    """The bound: a finite number > 0."""
    finite: bool = False
    """The bound: a finite number (no inf, no NaN)."""
    note: str = ""
    """Words the bound's error adds in parentheses: what the least value means ("0: never"), an
    example."""
    unit: str = ""
    """The unit after ``at_most`` in the error ("exceeds 1e+09 seconds")."""
    message: str = ""
    """The whole error instead of the generic one, with ``{flag}`` and ``{value}`` filled in."""

    def to_flag(self, value):
        """A field's value as its flag says it (``inverted``, ``zero_is_none``)."""
        if self.inverted:
            return not value
        return 0 if self.zero_is_none and value is None else value

    def to_field(self, value):
        """A flag's value as its field holds it (the inverse of ``to_flag``)."""
        if self.inverted:
            return not value
        return None if self.zero_is_none and value == 0 else value

    def text(self) -> str:
        """The help text (``help``, called if it is a callable)."""
        return self.help() if callable(self.help) else self.help

    def out_of_bounds(self, shown: str, value) -> str | None:
        """The one-line error for ``value`` of the flag ``shown`` outside the bound (None: within
        it, or left out): "--lr 0 must be a positive finite number", "--warmup -1 must be >= 0
        (0: no warm-up)", "--min-lr -1 must be a finite number >= 0"."""
        low, high, number = self.at_least, self.at_most, isinstance(value, float)
        if value is None:
            return None
        finite = math.isfinite(value) if number else True
        above = high is not None and finite and value > high
        if self.positive and not (finite and value > 0):
            bound = "a positive finite number"
        elif low is not None and not (finite and value >= low):
            bound = f"a finite number >= {low:g}" if number else f">= {low}"
        elif (self.finite or high is not None) and not finite:
            bound = "a finite number"
        elif not above:
            return None
        shown_value = f"{value:g}" if number else str(value)
        if self.message:
            return self.message.format(flag=shown, value=shown_value)
        note = f" ({self.note})" if self.note else ""
        if above:
            unit = f" {self.unit}" if self.unit else ""
            return f"{shown} {shown_value} exceeds {high:g}{unit}{note}"
        return f"{shown} {shown_value} must be {bound}{note}"


def option(
    default=MISSING,
    group: str | None = None,
    help: str | Callable[[], str] = "",
    *,
    default_factory=MISSING,
    **kw,
):
    """A ``dataclasses.field`` whose metadata declares its flag (``Option``: the keywords are its
    fields) and its bound (``at_least=1``, ``at_most=``, ``positive=True``, ``finite=True``;
    ``Option.out_of_bounds``)."""
    resume = kw.get("resume", "")
    if resume not in ("", "refuse", "warn"):
        raise ValueError(f"resume must be '', 'refuse' or 'warn', got {resume!r}")
    words = kw.pop("words", ())
    kw["words"] = words if isinstance(words, dict) else tuple(words)
    meta = {OPTION: Option(help, group, **kw)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_of(f: Field) -> Option | None:
    """The ``Option`` of a dataclass field, or None (a field without a flag)."""
    return f.metadata.get(OPTION)


def flat_name(f: Field) -> str:
    """The name a field of a nested config has in a flat one (``Option.name``, else its own)."""
    opt = option_of(f)
    return opt.name if opt is not None and opt.name else f.name


@dataclass(frozen=True)
class Flag:
    """One flag a dataclass field declares (``option``)."""

    name: str
    """Its flat name (``experts``: ``--experts``, the --config / train_config.json key)."""
    option: Option
    default: Any
    """Its default as the flag says it (None for a deferred one)."""
    hint: Any
    """The field's type (``int | None``), for the parser and --config files."""
    path: tuple[str, ...] = ()
    """Where a config holds it: ("num_experts",), ("moe_router", "score")."""


def declared_flags(cls: type, holder: tuple[str, ...] = ()) -> list[Flag]:
    """The ``Flag`` of every field of the dataclass ``cls`` declared with an ``option`` anywhere
    in its bases (a subclass that changes a default keeps its base's declaration), bases
    first; ``holder``: the path of the field that holds a ``cls``."""
    out: dict[str, Flag] = {}
    for klass in reversed(cls.__mro__):
        for name, f in klass.__dict__.get("__dataclass_fields__", {}).items():
            opt = option_of(f)
            if name in out or opt is None:
                continue
            default = opt.flag_default
            if default is FIELD_DEFAULT:
                default = opt.to_flag(f.default)
            hint = typing.get_type_hints(klass)[name]
            path = (*holder, name)
            out[name] = Flag(opt.name or name, opt, None if opt.deferred else default, hint, path)
    return list(out.values())


def nested_configs(cls: type) -> list[tuple[str, type]]:
    """The fields of the dataclass ``cls`` that hold a dataclass of their own (by their
    default factory: ``moe_router``, ``optimizer``), with its class."""
    made = [(f.name, f.default_factory()) for f in fields(cls) if f.default_factory is not MISSING]
    return [(name, type(value)) for name, value in made if is_dataclass(value)]


def lenient(cls: type, **kw):
    """``cls(**kw)`` (a frozen dataclass); where its own checks refuse a value, the object
    holding it unchecked, for a later check to name the flag (``TrainConfig.check``)."""
    try:
        return cls(**kw)
    except (ValueError, TypeError):
        obj = object.__new__(cls)
        for f in fields(cls):
            if f.name in kw:
                value = kw[f.name]
            elif f.default_factory is not MISSING:
                value = f.default_factory()
            else:
                value = f.default
            object.__setattr__(obj, f.name, value)
        return obj
