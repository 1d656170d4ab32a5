"""Command-line flags that were renamed: the old spelling stops with exit code 2 and names the new one.

Registered explicitly (and hidden from --help) rather than left unknown, because argparse would
otherwise take an old flag that is a prefix of the new one (`--seq` of `--seq-len`) as an
abbreviation and silently accept it.
"""

from __future__ import annotations

import argparse


def renamed_flag(parser: argparse.ArgumentParser, old: str, new: str, why: str = "") -> None:
    """Make `old` an error that names `new` (`why`, if given, says what the new name means)."""

    class _Renamed(argparse.Action):
        def __call__(self, p, namespace, values, option_string=None):
            reason = f" ({why})" if why else ""
            p.exit(2, f"{p.prog}: error: {old} was renamed to {new}{reason}; use {new}.\n")

    parser.add_argument(old, nargs="?", action=_Renamed, help=argparse.SUPPRESS, dest=f"_renamed_{old.lstrip('-')}")
