"""What the user documentation tells people to type exists in the code: every fenced `longctx ...`
command of README.md and docs/*.md parses with the real CLI parser (its leftover arguments being
config keys of the commands that take them), every `--section.key` the prose names is a config key,
and every flag of a `python benchmarks/X.py ...` command is one that script declares; so is every
`section.key` the prose names without the dashes, and every file, link, anchor and quoted section
another page is pointed at exists.

A renamed flag or key without its docs (or a doc typo) fails here, naming the file and line."""

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from longctx.cli import build_parser
from longctx.config import SECTIONS, fields_by_key

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = {f"{s}.{k}" for s, cls in SECTIONS.items() for k in fields_by_key(cls)}
OVERRIDE_COMMANDS = ("train", "generate", "eval", "plan")  # the commands that read --section.key=value
SECTION = r"(?:model|parallel|train|data|memory|checkpoint|metrics|draft)"


def _fenced_commands():
    """(file, line, argv after `longctx`) of every fenced command line, continuation lines joined."""
    out = []
    for path in DOCS:
        lines, fence, i = path.read_text().splitlines(), False, 0
        while i < len(lines):
            text = lines[i].strip()
            if text.startswith("```"):
                fence = not fence
            elif fence and text.startswith("longctx "):
                start = i
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                argv = shlex.split(text, comments=True)[1:]
                if argv and not argv[0].endswith(":"):  # (`longctx train: error: ...` is output, not a command)
                    argv = ["1" if re.fullmatch(r"\$\{?\w+\}?", a) else a for a in argv]  # a shell variable: a number
                    out.append((path.relative_to(ROOT), start + 1, argv))
            i += 1
    return out


COMMANDS = _fenced_commands()


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) >= 50  # (README's tour alone holds 28)


@pytest.mark.parametrize("where,line,argv", COMMANDS, ids=[f"{p}:{n}" for p, n, _ in COMMANDS])
def test_a_documented_command_parses(where, line, argv):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _, rest = build_parser(argv[0]).parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"{where}:{line}: `longctx {' '.join(argv)}` does not parse: {err.getvalue().strip()}")
    if argv[0] in OVERRIDE_COMMANDS:
        rest = [a for a in rest if not (a.startswith("--") and a[2:].split("=")[0] in KEYS)
                and not (not a.startswith("--") and rest.index(a) > 0 and rest[rest.index(a) - 1][2:] in KEYS)]
    assert not rest, f"{where}:{line}: `longctx {' '.join(argv)}`: arguments no parser takes: {rest}"


def test_every_config_flag_the_docs_name_exists():
    wrong = []
    for path in DOCS:
        for n, text in enumerate(path.read_text().splitlines(), 1):
            # --section.key, not a pattern (`--model.rope_*`, `--model.moe.KEY`)
            for m in re.finditer(rf"(?<![\w/.-])--({SECTION}\.[a-z_0-9.]*[a-z0-9_])(?![*\w.]|\.[A-Z])", text):
                if m.group(1) not in KEYS:
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: --{m.group(1)}")
    assert not wrong, "config flags that are no config key:\n" + "\n".join(wrong)


# named in prose and not config keys: a TOML table, a renamed key said as such, cgroup files
NOT_KEYS = {"model.moe", "parallel.split", "memory.max", "memory.current", "memory.limit_in_bytes",
            "memory.usage_in_bytes"}
FILE = r"\.(jsonl?|toml|png|py|md|safetensors)$"  # (metrics.jsonl, model.safetensors: files)


def test_every_config_key_the_prose_names_exists():
    """running.md said a stop on `train.time_limit` writes a line: no such key (the time limit is
    checkpoint.exit_after_minutes). benchmarks.md is left out: a dated record names keys as they were."""
    wrong = []
    for path in DOCS:
        if path.name == "benchmarks.md":
            continue
        for n, text in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(rf"(?<![\w/.-])({SECTION}\.[a-z_][a-z_0-9.]*[a-z0-9_])(?![\w*(-]|\.[A-Za-z])", text):
                key = m.group(1)
                if key not in KEYS | NOT_KEYS and not key.startswith("model.cfg.") and not re.search(FILE, key):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {key}")
    assert not wrong, "config keys the docs name that do not exist:\n" + "\n".join(wrong)


def _all_options() -> set[str]:
    found = set()

    def walk(parser):
        for action in parser._actions:
            found.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    walk(build_parser("bench"))
    return found


def test_every_flag_of_a_documented_longctx_command_exists():
    options, wrong = _all_options(), []
    for where, line, argv in COMMANDS:
        for a in argv:
            flag = a.split("=")[0]
            if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in options:
                wrong.append(f"{where}:{line}: {flag}")
    assert not wrong, "\n".join(wrong)


def test_every_flag_of_a_documented_benchmark_script_is_declared():
    wrong, seen = [], 0
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"(?:python|bash|sh) (benchmarks/[\w.]+)([^`\n]*(?:\n[^`\n]*){0,3}?)(?=`|\n\n|$)", text):
            script = ROOT / m.group(1)
            line = text[:m.start()].count("\n") + 1
            if not script.is_file():
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {m.group(1)} does not exist")
                continue
            seen += 1
            source = script.read_text()
            # (a `--section.key=...` is a config override the script passes on, not its own flag)
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)(?![\w.-])", m.group(2).split("`")[0]):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {m.group(1)} {flag}")
    assert seen >= 40 and not wrong, "\n".join(wrong)


def _titles(path: Path) -> tuple[set[str], list[str]]:
    """(GitHub anchors of the page's headings, its headings and bold run-in labels in lower case)."""
    anchors, titles, fence = set(), [], False
    for line in path.read_text().splitlines():
        fence ^= line.startswith("```")
        if fence or line.startswith("```"):
            continue
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            anchors.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
            titles.append(title.lower())
        titles += [b.lower() for b in re.findall(r"^(?:- )?\*\*([^*]+)\*\*", line)]
    return anchors, titles


def test_every_reference_to_a_file_anchor_or_section_exists():
    """A link, a repository path (docs/, benchmarks/, configs/, tests/, src/), a `docs/X.md#anchor` and a
    `X.md, "Section"` pointer lead somewhere: a renamed file, heading or section fails here."""
    pages = {p.name: _titles(p) for p in DOCS}
    wrong = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"\]\(([^)\s]+)\)|(?<![\w/.-])((?:docs|benchmarks|configs|tests|src)/[\w./-]*\w)"
                             r"(#[\w-]+)?(?![\w*<{./-])", text):
            where = f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            target, anchor = (m.group(1).partition("#")[::2] if m.group(1) else (m.group(2), (m.group(3) or "#")[1:]))
            if target.startswith("http"):
                continue
            file = (path.parent / target if m.group(1) else ROOT / target) if target else path
            if not file.exists():
                wrong.append(f"{where}: {target} does not exist")
            elif anchor and file.suffix == ".md" and anchor not in pages[file.name][0]:
                wrong.append(f"{where}: {file.name} has no heading #{anchor}")
        flat = " ".join(text.split())
        for m in re.finditer(r"(\w+\.md)(?:'s|,)? \"([^\"]{3,80})\"", flat):
            if m.group(1) in pages and not any(t.startswith(m.group(2).lower()) for t in pages[m.group(1)][1]):
                wrong.append(f"{path.relative_to(ROOT)}: {m.group(1)} has no section \"{m.group(2)}\"")
    assert not wrong, "\n".join(wrong)
