"""docs/architecture.md's map of src/longctx/ against the tree and against test_boundaries.FLOORS.

The map is the code block that opens with `src/longctx/`. In it:

- a floor heading is a line `floor N: NAME, NAME, ... -- what the floor is; what it may import`, where a
  NAME is a package (`job/`), a top-level module (`errors.py`) or the package's own `__init__.py`
  (the module `longctx`);
- an entry is a line indented by two spaces whose first word is a path relative to src/longctx/: a
  module (`job/comm.py`) or a package (`parallel/context/`, standing for its __init__.py); further
  lines of its description are indented to the description's column;
- any other line at column 0 (`benchmarks/`, the tests' line) ends the floors: what follows is not
  under src/longctx/.

The checks: every module under src/longctx (but __init__.py files) is an entry; every path the map
names, entries and paths in descriptions alike (`tests/...` and `benchmarks/...` from the
repository root, the rest from src/longctx/), exists; the floor headings name the same packages in
the same order as FLOORS (the import rules the boundaries test enforces); each entry is listed once,
under the heading of its own floor. Each check is also run on a copy of the map with one entry
removed, one stale entry added and a floor heading changed, to show that it reports them.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_boundaries import FLOORS

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "longctx"
DOC = ROOT / "docs" / "architecture.md"

HEADING = re.compile(r"^floor (\d+): (.+?) -- ")
ENTRY = re.compile(r"^  (\S+)")
# a .py path inside a description: not the tail of a longer word or path
MENTION = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
FROM_ROOT = ("tests/", "benchmarks/", "docs/", "src/")


def map_lines(text: str) -> list[str]:
    """The lines of the map: the code block whose first line starts with `src/longctx/`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("src/longctx/") and i and lines[i - 1].startswith("```"):
            end = next((j for j in range(i, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, "docs/architecture.md: the map's code block is not closed"
            return lines[i:end]
    raise AssertionError("docs/architecture.md has no map (a code block opening with `src/longctx/`)")


def _top(name: str) -> str:
    """The FLOORS name of a heading NAME or of an entry path's first part."""
    first = name.rstrip("/").split("/", 1)[0]
    if first == "__init__.py":
        return "longctx"
    return first[:-3] if first.endswith(".py") else first


def parse(text: str):
    """(floors, entries, mentions): floors = [(N, [heading NAMEs])] in map order; entries = [(floor
    index into floors, path)] for the entries under a floor heading; mentions = every .py path
    named anywhere in the map."""
    floors, entries, mentions = [], [], []
    current = None
    for line in map_lines(text)[1:]:
        mentions.extend(MENTION.findall(line))
        heading = HEADING.match(line)
        if heading:
            names = [n.strip() for n in heading.group(2).split(",")]
            floors.append((int(heading.group(1)), names))
            current = len(floors) - 1
        elif line and not line.startswith(" "):
            current = None  # a line at column 0 that is no heading: the floors end
        elif current is not None:
            entry = ENTRY.match(line)
            if entry and entry.group(1).endswith((".py", "/")):
                entries.append((current, entry.group(1)))
    return floors, entries, mentions


def missing_modules(text: str, src: Path = SRC) -> list[str]:
    """Modules under src (not __init__.py) that no entry names."""
    named = {path for _, path in parse(text)[1]}
    return sorted(str(p.relative_to(src)) for p in src.rglob("*.py")
                  if p.name != "__init__.py" and str(p.relative_to(src)) not in named)


def stale_paths(text: str, src: Path = SRC, root: Path = ROOT) -> list[str]:
    """Paths the map names that do not exist: entries (a module, or a package ending in /) and the
    .py paths of descriptions."""
    _, entries, mentions = parse(text)
    stale = []
    for _, path in entries:
        there = src / path
        if not (there.is_dir() if path.endswith("/") else there.is_file()):
            stale.append(path)
    for path in mentions:
        there = (root if path.startswith(FROM_ROOT) else src) / path
        if not there.is_file() and path not in stale:
            stale.append(path)
    return stale


def floor_mismatches(text: str, floors: list[set[str]] = FLOORS) -> list[str]:
    """Where the map's floor headings differ from `floors` (numbers, packages, order)."""
    found = []
    headings = parse(text)[0]
    for i, (number, _) in enumerate(headings):
        if number != i:
            found.append(f"heading {i} of the map is numbered floor {number}")
    for i in range(max(len(headings), len(floors))):
        ours = {_top(n) for n in headings[i][1]} if i < len(headings) else set()
        theirs = floors[i] if i < len(floors) else set()
        if ours != theirs:
            found.append(f"floor {i}: the map names {sorted(ours)}, FLOORS {sorted(theirs)}")
    return found


def misplaced_entries(text: str) -> list[str]:
    """Entries listed twice, or under a floor heading that does not name their package."""
    floors, entries, _ = parse(text)
    found, seen = [], set()
    for index, path in entries:
        if path in seen:
            found.append(f"{path} is listed twice")
        seen.add(path)
        tops = {_top(n) for n in floors[index][1]}
        if _top(path) not in tops:
            found.append(f"{path} sits under floor {floors[index][0]} ({', '.join(floors[index][1])})")
    return found


def _doc() -> str:
    return DOC.read_text()


def test_every_module_is_in_the_map():
    missing = missing_modules(_doc())
    assert not missing, f"modules missing from docs/architecture.md's map: {', '.join(missing)}"


def test_every_path_the_map_names_exists():
    stale = stale_paths(_doc())
    assert not stale, f"docs/architecture.md's map names paths that do not exist: {', '.join(stale)}"


def test_the_floor_headings_are_the_boundaries_floors():
    found = floor_mismatches(_doc())
    assert not found, ("docs/architecture.md's floor headings differ from FLOORS in "
                       "tests/unit/test_boundaries.py: " + "; ".join(found))


def test_each_entry_is_listed_once_under_its_floor():
    found = misplaced_entries(_doc())
    assert not found, "docs/architecture.md's map: " + "; ".join(found)


def _without_entry(text: str, path: str) -> str:
    """The text with the entry of `path` (its line and the description lines below it) removed."""
    lines, out, skipping = text.splitlines(), [], False
    for line in lines:
        if line.startswith(f"  {path} "):
            skipping = True
            continue
        if skipping and line.startswith("   "):
            continue
        skipping = False
        out.append(line)
    return "\n".join(out) + "\n"


def test_the_checks_report_what_was_planted():
    text = _doc()
    floors, entries, _ = parse(text)
    modules = [path for _, path in entries if path.endswith(".py") and "__init__" not in path]
    removed = modules[len(modules) // 2]
    stale = "train/step.py"  # moved to step/ (3faa61c)
    assert not (SRC / stale).exists()
    last_heading = next(line for line in map_lines(text) if HEADING.match(line)
                        and int(HEADING.match(line).group(1)) == floors[-1][0])
    planted = _without_entry(text, removed).replace(
        last_heading, f"{last_heading}\n  {stale}                    the pieces of a step")
    number, names = next((n, names) for n, names in floors if len(names) > 1)
    shared = next(line for line in map_lines(text) if line.startswith(f"floor {number}: "))
    planted = planted.replace(shared, shared.replace(f", {names[-1]} -- ", " -- ", 1))

    assert removed in missing_modules(planted)
    assert removed not in missing_modules(text)
    assert stale in stale_paths(planted)
    assert f"{stale} sits under floor {floors[-1][0]} ({', '.join(floors[-1][1])})" in misplaced_entries(planted)
    assert any(m.startswith(f"floor {number}:") and repr(_top(names[-1])) in m for m in floor_mismatches(planted))
    assert f"{removed} is listed twice" in misplaced_entries(text.replace(
        last_heading, f"{last_heading}\n  {removed}                    again"))
