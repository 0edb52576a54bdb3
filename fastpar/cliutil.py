"""The argument parser every ``python -m fastpar.*`` command uses (``Parser``): no prefix
matching (``--step 5`` is an error, never ``--steps``), and a bad command line ends with ONE
line, ``error: ...``, and exit code 2 instead of argparse's usage block; an unknown flag names
the nearest one (``error: unrecognized argument --microbatch; did you mean --microbatches?``)."""

from __future__ import annotations

import argparse
import difflib
import sys


def nearest_flag(arg: str, options: list[str]) -> str | None:
    """The option string of ``options`` closest to ``arg`` (its ``=value`` ignored), or None."""
    name = arg.split("=", 1)[0]
    near = difflib.get_close_matches(
        name, [o for o in options if o.startswith("--")], n=1, cutoff=0.6
    )
    return near[0] if near else None


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
