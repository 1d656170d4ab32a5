"""The documentation's commands, as `python benchmarks/readme_tour.py` (the README's promise that every
command of it and its topic pages runs) takes them: each is a program it can start or a command it skips
with its reason, never a comment line or a batch script's `srun` line that crashed the whole tour
(FileNotFoundError: '#', no JSON written), nor a placeholder it does not make (`/corpus`, `/models/...`)
run as a path; and the README names the pages the tour reads.

Fast: nothing runs; adapt() only turns a command into an argv."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme_tour  # noqa: E402

SUBS = {"/path/to/Qwen3-0.6B": "/made/Qwen3-0.6B", "/path/to/Qwen3-8B": "/made/Qwen3-8B",
        "/my/texts": "/made/texts", "/my/tokenizer.json": "/made/tokenizer.json"}
COMMANDS = [(page, cmd) for page in readme_tour.PAGES for cmd in readme_tour.readme_commands(ROOT / page)]


def test_the_tour_reads_commands():
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_each_command_is_a_program_the_tour_starts_or_a_skip_with_its_reason(page, cmd):
    argv, why = readme_tour.adapt(cmd, SUBS, None, False)
    if argv is None:
        assert why, f"{page}: `{cmd}` skipped without a reason"
        return
    assert argv[0] == sys.executable, f"{page}: `{cmd}` would start {argv[0]!r}, not python (-m longctx / torchrun)"


@pytest.mark.parametrize("page,cmd", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_no_command_runs_on_a_placeholder_the_tour_does_not_make(page, cmd):
    argv, _ = readme_tour.adapt(cmd, SUBS, None, False)
    if argv is None:
        return
    made = set(SUBS.values())
    for arg in argv[1:]:
        for path in re.findall(r"(?:^|[:=,])(/[\w./-]+)", arg):
            assert path in made or Path(path).exists(), f"{page}: `{cmd}` names {path}, which the tour does not make"


def _inputs(argv):
    """The data an argv reads: `--input` paths, `data merge`'s scans, `--data.path` stores."""
    out = []
    for i, arg in enumerate(argv):
        if arg in ("--input", "merge"):
            for a in argv[i + 1:]:
                if a.startswith("--"):
                    break
                out.append(a)
        if arg == "--data.path":
            out += argv[i + 1].split(",")
    return out


def test_every_store_or_input_a_command_reads_is_made_before_it():
    """In the tour's order: what a command reads is what prepare() makes or an earlier command wrote (--out)."""
    made = {"texts", "data.jsonl", "tokenizer.json", "configs", *SUBS.values()}
    missing = []
    for page, cmd in COMMANDS:
        argv, _ = readme_tour.adapt(cmd, SUBS, None, False)
        if argv is None:
            continue
        missing += [f"{page}: `{cmd}` reads {a}" for a in _inputs(argv) if a not in made]
        if "--out" in argv:
            made.add(argv[argv.index("--out") + 1])
    assert not missing, "inputs the tour neither makes nor writes before:\n" + "\n".join(missing)


def test_the_readme_names_the_pages_the_tour_reads():
    readme = (ROOT / "README.md").read_text()
    tour = readme.split("## A short tour", 1)[1].split("```", 1)[0]
    for page in readme_tour.PAGES[1:]:
        assert re.search(rf"\b{Path(page).stem}\b", tour), f"the README's tour paragraph does not name {page}"
    documented = {p.name for p in (ROOT / "docs").glob("*.md") if readme_tour.readme_commands(p)}
    skipped = sorted(documented - {Path(p).name for p in readme_tour.PAGES})
    assert not (skipped and "topic pages" in tour), f"the tour paragraph says it runs the topic pages; not {skipped}"


def _example_error(page: str, start: str) -> tuple[dict, list[str], str]:
    """(environment, config overrides, the error text) of a page's ``` example that begins `$ ...start`."""
    block = (ROOT / page).read_text().split(f"$ {start}", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    command = start + lines[0]
    while command.rstrip().endswith("\\"):
        lines.pop(0)
        command = command.rstrip()[:-1] + " " + lines[0].strip()
    words = command.split()
    env = dict(w.split("=", 1) for w in words[:words.index("longctx")])
    args = words[words.index("train") + 1:]
    overrides = [f"{args[i]}={args[i + 1]}" for i in range(0, len(args), 2) if args[i] != "--nproc"]
    text = " ".join(" ".join(lines[1:]).split())
    return env, overrides, text.removeprefix("longctx train: error: ")


def test_the_host_memory_refusal_shown_in_memory_md_is_what_the_run_says(monkeypatch):
    from longctx.config import load_config
    from longctx.errors import ConfigError
    from longctx.train.preflight import preflight

    env, overrides, shown = _example_error("docs/memory.md", "LONGCTX_HOST_MEMORY_BYTES=")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, overrides), 1)
    said = " ".join(str(err.value).split())
    at = 0
    for piece in shown.split("(...)"):  # the page elides a part of the message as (...)
        found = said.find(piece.strip(), at)
        assert found >= 0, f"docs/memory.md shows {piece.strip()!r}; the run says {said!r}"
        at = found + len(piece.strip())


def test_the_default_layout_paragraph_says_what_generation_runs_on_an_odd_nproc():
    """parallelism.md said `train`, `eval` and `generate` choose the default layout alike, an odd N running
    data parallel alone; generation has no data parallelism and runs an odd N as ctx N (cache_layout)."""
    from longctx.config.layout import cache_layout, default_layout

    text = " ".join((ROOT / "docs" / "parallelism.md").read_text().split())
    paragraph = text[text.index("With no degree given"):].split("**", 1)[0]
    for n in (3, 5, 7):
        if cache_layout(n) != default_layout(n):
            assert f"ctx {cache_layout(n)['ctx']}" in paragraph or "ctx N" in paragraph.split("odd N", 1)[-1], \
                f"--nproc {n}: generation runs {cache_layout(n)}, train {default_layout(n)}: the paragraph says alike"
            assert "`generate` choose it alike" not in paragraph


def _train_overrides(argv):
    """(the --config path, the --section.key=value overrides) of an adapted `longctx train` argv."""
    args, config, overrides, i = argv[argv.index("train") + 1:], None, [], 0
    while i < len(args):
        if args[i] == "--config":
            config = str(ROOT / args[i + 1])
        elif "." in args[i] and args[i].startswith("--"):
            overrides.append(f"{args[i]}={args[i + 1]}")
        i += 1 if "=" in args[i] else 2
    return config, overrides


def test_a_shortened_training_command_is_a_config_the_run_takes():
    """The tour appended --train.steps to configs/passkey-pretrain.toml and extend.toml, whose train.stages
    make train.steps their sum: `train.steps = 20 contradicts train.stages`, so eval.md's recipe failed
    in the tour and every command after it read no checkpoint."""
    from longctx.config import load_config
    from longctx.errors import UserError

    checked = 0
    for page, cmd in COMMANDS:
        argv, _ = readme_tour.adapt(cmd, SUBS, None, False)
        if argv is None or "train" not in argv or "--config" not in argv:
            continue
        config, overrides = _train_overrides(argv)
        checked += 1
        try:
            cfg = load_config(config, overrides)
        except UserError as e:  # (a checkpoint an earlier command of the tour writes is not here)
            assert "holds no complete longctx checkpoint" in str(e), f"{page}: `{cmd}` as the tour runs it: {e}"
            continue
        assert cfg.train.steps <= 2 * readme_tour.TOUR_STEPS or "--checkpoint.interval" in argv, \
            f"{page}: `{cmd}` trains {cfg.train.steps} steps in the tour"
    assert checked >= 4
