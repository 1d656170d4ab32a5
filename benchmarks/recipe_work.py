"""What the recipe benchmarks (extension_recipe.py, glide_recipe.py) share: running `longctx` as a user
does, and a working directory whose training phases, once timed, are not run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def longctx(*args: str, cwd: Path) -> tuple[float, str]:
    """Run `python -m longctx ARGS` in `cwd`: (wall seconds, stdout); exit with its output if it fails."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "longctx", *args], cwd=cwd, text=True, capture_output=True,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if r.returncode:
        sys.exit(f"longctx {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0, r.stdout


class RecipeWork:
    """`work` (a fresh temporary directory when empty) with the repository's configs linked in, and
    `seconds`: the wall time of each phase, kept in train_seconds.json so that `train` skips a phase
    an earlier run there finished."""

    def __init__(self, work: str, prefix: str):
        self.dir = Path(work) if work else Path(tempfile.mkdtemp(prefix=prefix))
        self.dir.mkdir(parents=True, exist_ok=True)
        print(f"working in {self.dir}", file=sys.stderr)
        if not (self.dir / "configs").exists():
            (self.dir / "configs").symlink_to(ROOT / "configs")
        self._timings = self.dir / "train_seconds.json"
        self.seconds = json.loads(self._timings.read_text()) if self._timings.is_file() else {}

    def train(self, phase: str, config: str, *extra: str) -> None:
        """`longctx train --config CONFIG --nproc 1` into runs/PHASE, unless already timed here."""
        if phase in self.seconds:
            print(f"{phase}: reusing {self.dir / 'runs' / phase} ({self.seconds[phase]:.0f} s when it ran)",
                  file=sys.stderr)
            return
        print(f"{phase}: training ({config})", file=sys.stderr)
        self.seconds[phase], _ = longctx("train", "--config", config, "--nproc", "1", "--train.run_dir",
                                         f"runs/{phase}", "--metrics.progress", "false", *extra, cwd=self.dir)
        self._timings.write_text(json.dumps(self.seconds))

    def run(self, name: str, *args: str) -> str:
        """A timed `longctx` command (not kept between runs): its stdout."""
        self.seconds[name], out = longctx(*args, cwd=self.dir)
        return out

    def json_phase(self, name: str, *args: str) -> dict:
        """A timed `longctx` command whose stdout is JSON, kept in WORK/results/NAME.json: a rerun in the
        same directory reads it back instead of running it again."""
        path = self.dir / "results" / (name.replace(" ", "_").replace("@", "_") + ".json")
        if path.is_file():
            print(f"{name}: reusing {path}", file=sys.stderr)
            return json.loads(path.read_text())
        print(f"{name}: running", file=sys.stderr)
        self.seconds[name], out = longctx(*args, cwd=self.dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out)
        self._timings.write_text(json.dumps(self.seconds))
        return json.loads(out)
