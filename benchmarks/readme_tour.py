"""Run every command of the README as written, and time each: the README's promises, checked.

The commands are read from the README and the topic pages of PAGES (their ```bash blocks, then
the README's ```python blocks, each run as a script), so a command added there is run here. Each
runs in a scratch working directory (runs/, stores/, out/ land there) in which:
  - placeholders name real things made for the tour: /path/to/Qwen3-0.6B a small random Qwen3 saved
    by transformers, with the tour's tokenizer.json (a model's own tokenizer goes with it),
    /path/to/Qwen3-8B a config.json of Qwen3-8B's shapes, /my/texts and data.jsonl
    part of the Python standard library's sources, /my/tokenizer.json a 1,000-token tokenizer;
    runs/20261122-173051-debug the tour's first run;
  - training commands get `--train.steps N` appended (a later key wins; a config of train.stages gets its
    stages at N / stages steps each instead) to keep the tour short, except
    the two whose timings the README quotes (`longctx train` and `longctx train --nproc 1`), which
    run as they are; the checkpoint pair gets enough steps to save and then resume;
  - the `pip install ... &&` prefixes are dropped (the tour runs in the installed environment) and
    `pytest` runs only with --with-tests; torchrun across nodes (a rendezvous HOST) is skipped, and so are
    comment lines, a batch script's lines (srun, scontrol) and commands on the reader's own data (NOT_MADE).
Prints one JSON document (each command, its exit code and seconds, with the conditions they hold
under: the machine, and per command the load average before it and the CPU seconds it used, so a
time measured beside other work reads as such); exits non-zero if any failed.
Usage: python benchmarks/readme_tour.py [--with-tests] [--only SUBSTRING]... [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the README, then its topic pages, in the order a reader meets them
PAGES = ["README.md", *(f"docs/{name}.md" for name in ("parallelism", "memory", "data", "checkpoints", "planner",
                                                      "eval", "running"))]
TOUR_STEPS = 20
FULL_RUNS = ("longctx train", "longctx train --nproc 1")  # the README quotes their timings


def readme_commands(readme: Path) -> list[str]:
    """The shell commands of the README's ```bash blocks, comments stripped, continuations joined."""
    cmds, block, pending = [], False, ""
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        line = pending + line.strip()
        if line.startswith("#"):  # a comment line (or a batch script's #SBATCH directive): no command
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        code = line.split(" #")[0].strip()
        if code:
            cmds.append(code)
    return cmds


def readme_python(readme: Path) -> list[str]:
    """The README's ```python blocks, each as one script."""
    blocks, current = [], None
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            if current is not None:
                blocks.append("\n".join(current) + "\n")
                current = None
            elif line.strip() == "```python":
                current = []
            continue
        if current is not None:
            current.append(line)
    return blocks


def prepare(work: Path) -> dict[str, str]:
    """The things the README's placeholders stand for, made in `work`; returns the substitutions."""
    shutil.copytree(ROOT / "configs", work / "configs", dirs_exist_ok=True)  # (a --keep DIR toured before: reused)
    texts = work / "texts"
    texts.mkdir(exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:120]
    for p in files[:100]:
        shutil.copy(p, texts / (p.stem + ".txt"))
    with (work / "data.jsonl").open("w") as f:
        for p in files[100:]:
            f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(p) for p in texts.iterdir()], trainers.BpeTrainer(vocab_size=1000, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(work / "tokenizer.json"))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    small = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096,
                        tie_word_embeddings=True)
    Qwen3ForCausalLM(small).save_pretrained(work / "Qwen3-0.6B", safe_serialization=True)
    shutil.copy(work / "tokenizer.json", work / "Qwen3-0.6B" / "tokenizer.json")
    big = work / "Qwen3-8B"
    big.mkdir(exist_ok=True)
    (big / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return {"/path/to/Qwen3-0.6B": str(work / "Qwen3-0.6B"), "/path/to/Qwen3-8B": str(big),
            "/my/texts": str(texts), "/my/tokenizer.json": str(work / "tokenizer.json")}


# what the topic pages' commands name that stands for the reader's own data, which the tour does not make
NOT_MADE = {r"(?<![\w/])/corpus\b": "your corpus", r"\bscans/[1-9]": "the other machines' scans",
            r"\bqa\.jsonl\b": "your instruction data", r"\bchats\.jsonl\b": "your conversations",
            r"(?<![\w/])/models/": "a local Hugging Face model", r"\bstores/books\b": "your stores"}
PROGRAMS = ("longctx", "torchrun", "pytest")  # what the tour starts (pip lines are dropped or skipped)


def adapt(cmd: str, subs: dict[str, str], first_run: str | None, with_tests: bool) -> tuple[list[str] | None, str]:
    """(argv to run, or None to skip; why)."""
    cmd = re.sub(r"^pip install [^&]*&&\s*", "", cmd)
    if cmd.startswith("pip "):
        return None, "install step (the tour runs in the installed environment)"
    if (program := cmd.split(" ", 1)[0]) not in PROGRAMS:
        return None, f"`{program}`: a batch script's line (Slurm), not a command the tour runs"
    for pattern, what in NOT_MADE.items():
        if re.search(pattern, cmd):
            return None, f"names {what}, which the tour does not make"
    if cmd == "pytest":
        return ([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests")], "") if with_tests else \
            (None, "the test suite (run with --with-tests)")
    if "--rdzv-endpoint HOST" in cmd:
        return None, "needs several machines"
    for k, v in subs.items():
        cmd = cmd.replace(k, v)
    if first_run:
        cmd = cmd.replace("runs/20261122-173051-debug", first_run)
    argv = shlex.split(cmd)
    if argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    elif argv[0] == "longctx":
        argv = [sys.executable, "-m", "longctx", *argv[1:]]
    subcommand = argv[argv.index("longctx") + 1] if "longctx" in argv else ""
    if subcommand == "train" and "--help" not in argv and "--print-config" not in argv and cmd not in FULL_RUNS:
        steps = TOUR_STEPS
        if "--checkpoint.interval" in argv:
            steps = int(argv[argv.index("--checkpoint.interval") + 1]) + 10  # one save, then steps after it
        if "--checkpoint.resume" in argv:
            steps = 10**6  # filled in below: past the saved step
        if "32768" in argv:
            steps = 3
        stages = _config_stages(argv)
        if stages:  # train.steps is the stages' sum, so a config of stages is shortened stage by stage
            cut = max(1, steps // len(stages))
            argv += ["--train.stages", ",".join(":".join([length, str(cut), *rest]) for length, _, *rest in stages)]
        else:
            argv += ["--train.steps", str(steps)]
    return argv, ""


def _config_stages(argv: list[str]) -> list[list[str]]:
    """The train.stages of the command's --config (SEQ_LEN:STEPS[:GLOBAL_BATCH] each), or [] when it has none."""
    from longctx.config.load import tomllib  # (tomli before Python 3.11, which the project still supports)

    if "--config" not in argv or not (ROOT / argv[argv.index("--config") + 1]).is_file():
        return []
    with (ROOT / argv[argv.index("--config") + 1]).open("rb") as f:
        stages = tomllib.load(f).get("train", {}).get("stages", "")
    return [stage.strip().split(":") for stage in stages.split(",") if stage.strip()]


def _machine() -> dict:
    """What the times assume: the CPU, its usable cores, torch, the thread settings."""
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    import torch

    return {"cpu": cpu, "usable_cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            **{k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}}


def _conditions() -> tuple[float, float]:
    """(the 1-minute load average now, the CPU seconds children have used so far)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return os.getloadavg()[0], ru.ru_utime + ru.ru_stime


def _used(before: tuple[float, float], seconds: float) -> dict:
    """A command's conditions: the load before it (other work on the machine; an idle one reads < 0.5)
    and the CPU seconds it used, per second of its wall time (about the cores it kept busy)."""
    load, cpu0 = before
    cpu = _conditions()[1] - cpu0
    return {"load_before": round(load, 2), "cpu_seconds": round(cpu, 1),
            "cores_busy": round(cpu / seconds, 2) if seconds > 0 else None}


def _run(argv: list[str], label: str, work: Path, env: dict,
         logs: Path | None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run one command in `work`: (its result, its record: exit code, seconds, conditions, stderr's tail on a
    failure, the done: line). With --keep, its whole output is kept in logs/NN.txt (what it printed, to read)."""
    t0, before = time.perf_counter(), _conditions()
    try:
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    except OSError as e:  # a program that cannot start is this command's failure, not the tour's end
        r = subprocess.CompletedProcess(argv, 127, "", str(e))
    seconds = time.perf_counter() - t0
    rec = {"command": label, "exit_code": r.returncode, "seconds": round(seconds, 1), **_used(before, seconds)}
    if r.returncode:
        rec["stderr_tail"] = r.stderr[-2000:]
    done = [x for x in r.stdout.splitlines() if x.startswith("done:")]
    if done:
        rec["summary"] = done[-1]
    if logs is not None:
        logs.mkdir(exist_ok=True)
        log = logs / f"{len(list(logs.glob('*.txt'))):02d}.txt"
        log.write_text(f"$ {label}\n{' '.join(argv)}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr}")
        rec["log"] = str(log)
    print(f"{'ok ' if r.returncode == 0 else 'FAIL'} {seconds:7.1f}s  {label}", file=sys.stderr, flush=True)
    return r, rec


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--with-tests", action="store_true", help="also run the README's test command")
    p.add_argument("--only", action="append", default=[],
                   help="run only the commands containing this text (repeated: any of them)")
    p.add_argument("--keep", default="", help="work in this directory and keep it (each command's output: logs/)")
    a = p.parse_args()
    work = Path(a.keep or tempfile.mkdtemp(prefix="readme-tour-"))
    work.mkdir(parents=True, exist_ok=True)
    env, logs = {**os.environ, "PYTHONUNBUFFERED": "1"}, (work / "logs" if a.keep else None)
    print(f"readme tour in {work}", file=sys.stderr)
    subs = prepare(work)
    results, first_run, saved_steps = [], None, 0
    for cmd in (c for page in PAGES for c in readme_commands(ROOT / page)):
        if a.only and not any(text in cmd for text in a.only):
            continue
        argv, why = adapt(cmd, subs, first_run, a.with_tests)
        if argv is None:
            results.append({"command": cmd, "skipped": why})
            continue
        if "--train.steps" in argv and argv[argv.index("--train.steps") + 1] == str(10**6):
            argv[argv.index("--train.steps") + 1] = str(saved_steps + TOUR_STEPS)
        r, rec = _run(argv, cmd, work, env, logs)
        found = re.search(r"run directory: (\S+)", r.stdout)
        if found and first_run is None:
            first_run = found.group(1)
        saved = re.findall(r"checkpoint: saved step (\d+)", r.stdout)
        if saved:
            saved_steps = int(saved[-1])
        results.append({"command": cmd, "ran": " ".join(argv[2:] if argv[0] == sys.executable else argv), **rec})
    for i, code in enumerate(readme_python(ROOT / "README.md")):
        if a.only and not any(text in code for text in a.only):
            continue
        for k, v in subs.items():
            code = code.replace(k, v)
        results.append(_run([sys.executable, "-c", code], f"README python block {i + 1}", work, env, logs)[1])
    failed = [r for r in results if r.get("exit_code")]
    print(json.dumps({"bench": "readme_tour", "date": time.strftime("%Y-%m-%d"), "work": str(work),
                      "machine": _machine(), "commands": results, "failed": len(failed)}, indent=1))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
