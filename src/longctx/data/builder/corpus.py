"""The document type the readers yield, and the default corpus: the standard library, no download.

The embedded default corpus is the Python standard library's own `.py` files, found at run time
with `sysconfig` (site-packages excluded): real text, varied, with documents from a few bytes to
several hundred kilobytes.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataError

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".html", ".tex"}


@dataclass
class Document:
    name: str  # stable identifier (path relative to the corpus root)
    text: str
    # instruction data: the character offsets where training starts and stops, (start, stop, start, ...,
    # start), the last span to the end; only those tokens (and the EOS) are trained on (tokenize.py
    # tokenize_answers). An instruction pair (`--response-field`, text = prompt + response): (response start,);
    # a conversation (--messages-field): each answer's span. None: a plain document, trained on whole
    trained_chars: tuple[int, ...] | None = None
    # rendered by a chat template (--messages-field): its special tokens, BOS included where the template
    # writes one, are all it begins with (transformers' apply_chat_template adds none); no prefix is added
    templated: bool = False


def hidden(rel: Path) -> bool:
    """A path (relative to an input directory) that is a dotfile or lies under a dot-directory: .git's
    objects, a .venv's installed packages or a tool's cache are not the corpus a user points at."""
    return any(part.startswith(".") for part in rel.parts)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_installed_package(rel: Path) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in rel.parts)


def _stdlib_sources(root: Path) -> list[Path]:
    """The .py files under the standard library's root, not descending into installed packages:
    site-packages can hold tens of thousands of files, and every run fingerprints this list."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _is_installed_package(Path(d))]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return out


def stdlib_files() -> tuple[Path, list[Path]]:
    """(root, sorted .py files) of the default corpus, 'stdlib' (a directory input is listed by
    inputs.py input_files, as every other input)."""
    root = stdlib_root()
    files = sorted(_stdlib_sources(root))
    if not files:
        raise DataError(f"the default corpus 'stdlib' holds no .py files under {root} (a Python installed without "
                        f"its standard library's sources); pass a directory of text files as data.corpus instead.")
    return root, files
