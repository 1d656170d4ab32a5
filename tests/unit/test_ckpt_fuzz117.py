"""A randomized audit of checkpoint saving, retention, resume, verification and export (ckpt fuzz 117).

Each case is a random sequence of runs of the debug model (1 layer) in one run directory: random
checkpoint.interval / keep / final / async / on_save_error, a full disk at a random save (LONGCTX_FAULT=enospc@k),
resumes with other retention settings (auto, or an explicit older checkpoint: another attempt), and between runs
random damage (a shard half-written, a file deleted by hand, manifest.json truncated, a killed save's leftover).

`Ref` below is written from the documented rules only (docs/checkpoints.md, checkpoint.* in config/schema.py,
train/saves.py's docstring), not from the code: which step directories exist after each run, what `latest`
names, which checkpoint `--checkpoint.resume auto` loads, whether a run stops, and what `checkpoint verify` says.
Every kept checkpoint's weights and AdamW state are compared bitwise with the in-memory state captured when its
save was called, and an export of a random kept step reads back (longctx and transformers) to those weights.
"""

import json
import os
import random
import shutil
import signal
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._pytree import tree_map

from longctx.checkpoint.manifest import DamagedManifest
from longctx.checkpoint.verify_command import verify_lines
from longctx.cli import main
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError, step_name
from longctx.errors import ConfigError, Preempted, TrainingError
from longctx.train.trainer import Trainer

BASE = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
        "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu", "--model.layers=1"]
DAMAGE = ("shard", "deleted", "manifest", "leftover", "removed", "latest", "moved")


class Ref:
    """The documented rules. dirs: name -> {step, version, parent (name, version) or None, damage}."""

    def __init__(self):
        self.dirs, self.latest, self.versions, self.runs = {}, None, 0, 0
        self.rolled_back = {}  # version -> the bad step of the newest rollback to it: a resume goes on after it
        self.moved = None  # a checkpoint a killed re-save moved aside, put back by the next start

    def due(self, start, steps, interval, final):
        """checkpoint.interval: every N steps and the last; checkpoint.final: the last."""
        return [s for s in range(start + 1, steps + 1) if (interval and s % interval == 0)
                or (s == steps and (interval or final))]

    def chain(self, name):
        """`name` and the checkpoints its manifest's parents name, while each is the very one named (same version,
        its manifest intact); a checkpoint whose manifest is unreadable names no parent: every older complete one."""
        out, at = [name], self.dirs[name]
        while True:
            if at["damage"] == "manifest":
                return out + sorted((n for n in self.dirs if n < out[-1]), reverse=True)
            if at["parent"] is None:
                return out
            pname, pversion = at["parent"]
            held = self.dirs.get(pname)
            if held is None or held["version"] != pversion or held["damage"] == "manifest" or pname >= out[-1]:
                return out
            out.append(pname)
            at = held

    def start(self, name):
        """The step a resume from `name` goes on after: its own, or past the bad step of a rollback to it."""
        return self.rolled_back.get(self.dirs[name]["version"], self.dirs[name]["step"])

    def first(self):
        """The checkpoint `latest` names, else (it names none that is there) the newest complete one."""
        return self.latest if self.latest in self.dirs else max(self.dirs, default=None)

    def pick(self):
        """resume auto: the checkpoint `latest` names (else the newest), then its ancestors; the first intact.
        (None, False): nothing to resume; (None, True): none intact, an error."""
        first = self.first()
        if first is None:
            return None, False
        intact = [n for n in self.chain(first) if self.dirs[n]["damage"] is None]
        return (intact[0], False) if intact else (None, True)

    def run(self, own, start, steps, interval, final, keep, on_error, fault, signal=None, bad=None):
        """The saves of one run that continues `own` (None: fresh) from `start`; returns how it ends: 'error' (a
        CheckpointError), 'signal' (Preempted), 'bad' (a TrainingError) or 'done'. A failed save commits nothing and
        leaves `latest`; under warn the run trains on, except after the run's last save (no later save tries
        again); an async failure is the same on disk. A signal during step `signal` saves that step unless its due
        save was made, and that save failing stops the run whatever the policy. A bad step `bad` under
        train.on_nonfinite = rollback is never saved: the run goes back to its own newest checkpoint (none: it
        stops) and on at the next step, whose saves are due as before."""
        self.parent = None if own is None else (own, self.dirs[own]["version"])
        self.runs += 1
        ordinal, made = 0, set()
        for s in sorted(set(self.due(start, steps, interval, final)) | ({bad} if bad else set())):
            if signal is not None and s > signal:
                break
            if s == bad:
                if self.parent is None:
                    return "bad"
                self.rolled_back[self.parent[1]] = bad
                continue
            ordinal += 1
            if ordinal == fault:
                if on_error == "stop" or s == steps:
                    return "error"
                continue
            self.commit(s, keep, ordinal)
            made.add(s)
        if signal is None:
            return "done"
        if signal not in made:
            if ordinal + 1 == fault:
                return "error"
            self.commit(signal, keep, ordinal + 1)
        return "signal"

    def commit(self, s, keep, ordinal):
        """The `ordinal`-th save call of this run commits step `s`; keep-last prunes along its trajectory."""
        self.versions += 1
        name = step_name(s)
        self.dirs[name] = {"step": s, "version": self.versions, "parent": self.parent, "damage": None,
                           "call": (self.runs, ordinal)}
        self.parent, self.latest = (name, self.versions), name
        for old in self.chain(name)[keep:]:  # keep-last along this run's trajectory only
            del self.dirs[old]


def _clone(tree):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _trainer(run_dir, captured, run, *args):
    """The Trainer of run number `run`; captured[(run, k)]: the states its k-th save call was given."""
    cfg = load_config(None, [*BASE, f"--train.run_dir={run_dir}", *args])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    if trainer.ckpt is not None:
        save, calls = trainer.ckpt.save, [0]

        def capturing(step, model, optimizer, sampler_state):  # the in-memory state when the save is called
            calls[0] += 1
            captured[(run, calls[0])] = _clone(get_state_dict(model, optimizer))
            return save(step, model, optimizer, sampler_state)

        trainer.ckpt.save = capturing
    return trainer


def _signal_at(trainer, at):
    step = trainer.step

    def signalled(s):  # SIGTERM during step `at` (the run finishes it, saves it and stops)
        if s == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(s)

    trainer.step = signalled


def _settings(rng):
    return dict(interval=rng.choice([0, 1, 2, 3]), final=rng.random() < 0.7, keep=rng.choice([1, 2, 3, 5]),
                async_=rng.random() < 0.5, on_error=rng.choice(["stop", "warn"]),
                fault=rng.choice([0, 0, 0, 1, 2, 3]))


def _damage(rng, root, ref, dirs):
    """Harm a random existing checkpoint (or leave a killed save's temporary directory); recorded in `ref`."""
    kind = rng.choice(DAMAGE)
    intact = [n for n, d in dirs.items() if d["damage"] is None]
    if kind == "latest" and (root / "latest").is_file():  # garbled: the newest complete one is `latest` then
        (root / "latest").write_bytes(b"\xff\xfe step-")
        ref.latest = None
        return
    if kind in ("leftover", "latest") or len(intact) < 2:  # (one intact kept at least: most cases resume)
        tmp = root / f".tmp-{step_name(99)}-deadbeef"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "__0_0.distcp").write_bytes(b"half")
        return
    name = rng.choice(sorted(intact))
    victim = root / name
    if kind == "removed":  # the whole directory, by hand
        shutil.rmtree(victim)
        del ref.dirs[name]
        return
    if kind == "moved":  # a re-save's commit killed after it moved the old one aside: put back at the next start
        os.replace(victim, root / f".tmp-old-{name}-deadbeef")
        ref.moved = name
        return
    if kind == "shard":  # half-written
        data = (victim / "__0_0.distcp").read_bytes()
        (victim / "__0_0.distcp").write_bytes(data[:len(data) // 2])
    elif kind == "deleted":
        (victim / rng.choice(["trainer_state.json", "rng-rank0.pt", ".metadata"])).unlink()
    else:
        text = (victim / "manifest.json").read_text()
        (victim / "manifest.json").write_text(text[:len(text) // 2])
    ref.dirs[name]["damage"] = kind


def _check_disk(root, ref, where):
    on_disk = sorted(p.name for p in root.glob("step-*"))
    assert on_disk == sorted(ref.dirs), f"{where}: step directories {on_disk}, the rules keep {sorted(ref.dirs)}"
    assert not list(root.glob(".tmp-*")), f"{where}: leftovers {list(root.glob('.tmp-*'))}"
    if ref.latest is not None:
        assert (root / "latest").read_text().strip() == ref.latest, f"{where}: latest"


def _check_verify(root, ref):
    """`checkpoint verify` of each kept checkpoint: OK when intact; else names the harmed file, or (a truncated
    manifest) refuses it as damaged. Of the directory: the checkpoint `latest` names."""
    first = ref.first()
    if first is not None and ref.dirs[first]["damage"] != "manifest":
        assert verify_lines(root)[0][0].startswith(f"checkpoint {root / first} (the latest")
        # (the command itself, on the directory: exit 0 when intact, else its error after the lines)
        assert main(["checkpoint", "verify", str(root)]) == (0 if ref.dirs[first]["damage"] is None else 1)
    for name, d in ref.dirs.items():
        if d["damage"] == "manifest":
            with pytest.raises(DamagedManifest):
                verify_lines(root / name)
            continue
        lines, problems = verify_lines(root / name)
        if d["damage"] is None:
            assert not problems and lines[-1].startswith(f"OK: step {d['step']},"), lines
        else:
            assert problems and lines[-1].startswith(f"DAMAGED: {len(problems)} of"), lines


def _check_bitwise(root, ref, captured):
    """Each intact kept checkpoint holds, bit for bit, the weights and AdamW state captured at its step."""
    for name, d in ref.dirs.items():
        if d["damage"] is not None:
            continue
        want = captured[d["call"]]
        got = tree_map(lambda t: torch.full_like(t, float("nan")) if isinstance(t, torch.Tensor) else t, want)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": got[0], "optim": got[1]}, checkpoint_id=str(root / name), no_dist=True)
        pairs = [*((got[0][k], v) for k, v in want[0].items()),
                 *((got[1]["state"][p][k], v) for p, st in want[1]["state"].items() for k, v in st.items())]
        for a, b in pairs:
            assert torch.equal(a, b), f"{name}: a tensor differs from the state its save was given"


def _segment(tmp_path, monkeypatch, rng, ref, captured, first, staged):
    """One run: fresh (first), resume auto, or an explicit resume of an older intact checkpoint; `staged`: under
    train.stages (2 steps at 32 tokens, then 64: the resumes lengthen the last stage)."""
    root = tmp_path / "checkpoints"
    s = _settings(rng)
    explicit = None
    # (one moved aside too: an explicit resume of it puts it back first, train/moved_aside.py)
    intact = sorted(n for n, d in ref.dirs.items() if d["damage"] is None)
    if not first and len(intact) > 1 and rng.random() < 0.3:
        explicit = intact[rng.randrange(len(intact) - 1)]  # an older one: the newer are another attempt's
    own, refused = (explicit, False) if explicit else (None, False) if first else ref.pick()
    start = 0 if own is None else ref.start(own)
    steps = max(start + rng.randint(1, 7), 3 if staged else 1)
    if not (s["interval"] or s["final"]):
        s["final"] = True  # (a resume that turns saving off is refused unless allowed: not this audit's subject)
    resume = "none" if first else str(root / explicit) if explicit else "auto"
    args = [f"--train.stages=32:2,64:{steps - 2}" if staged else f"--train.steps={steps}",
            f"--checkpoint.interval={s['interval']}", f"--checkpoint.keep={s['keep']}",
            f"--checkpoint.final={str(s['final']).lower()}", f"--checkpoint.async={str(s['async_']).lower()}",
            f"--checkpoint.on_save_error={s['on_error']}", f"--checkpoint.resume={resume}"]
    bad = rng.randrange(start + 1, steps + 1) if s["interval"] and rng.random() < 0.25 else None
    if bad:  # a non-finite loss at step `bad`, rolled back (its loss read at once: log_interval 1)
        args += ["--train.on_nonfinite=rollback", "--metrics.log_interval=1"]
    faults = ",".join([*([f"enospc@{s['fault']}"] if s["fault"] else []), *([f"nonfinite@{bad}"] if bad else [])])
    story = f"{args} LONGCTX_FAULT={faults}"
    if faults:  # (read when the run starts: the k-th save of this run fails; step `bad`'s loss is NaN)
        monkeypatch.setenv("LONGCTX_FAULT", faults)
    else:
        monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    if refused or (own is None and not first):  # none intact; none at all in a directory that holds a run
        with pytest.raises(CheckpointError if refused else ConfigError,
                           match="no complete checkpoint .* is intact" if refused else "found no checkpoint"):
            _trainer(tmp_path, captured, ref.runs + 1, *args)
        return story + " -> refused", False
    trainer = _trainer(tmp_path, captured, ref.runs + 1, *args)
    ref.moved = None
    if own is not None:
        assert trainer.start_step == start and trainer.ckpt.resumed_from[0].name == own, story
    sig = rng.randrange(start + 1, steps) if steps - start > 1 and not bad and rng.random() < 0.3 else None
    story += f" SIGTERM in step {sig}" if sig else ""
    if sig:
        _signal_at(trainer, sig)
    expected = ref.run(own, start, steps, s["interval"], s["final"], s["keep"], s["on_error"], s["fault"], sig, bad)
    try:
        trainer.run()
        ended = "done"
    except CheckpointError:
        ended = "error"
    except Preempted:
        ended = "signal"
    except TrainingError:
        ended = "bad"
    assert ended == expected, f"{story}: the run ended with {ended}; the rules say {expected}"
    _check_disk(root, ref, story)
    return story, True


def _audit(tmp_path, monkeypatch, seed, runs):
    rng = random.Random(seed)
    ref, captured, history = Ref(), {}, []
    root = tmp_path / "checkpoints"
    staged = rng.random() < 0.3
    for i in range(runs):
        story, ok = _segment(tmp_path, monkeypatch, rng, ref, captured, i == 0, staged)
        history.append(story)
        if not ok:
            break
        _check_verify(root, ref)
        _check_bitwise(root, ref, captured)
        if rng.random() < 0.5:
            _damage(rng, root, ref, ref.dirs)
    monkeypatch.delenv("LONGCTX_FAULT", raising=False)
    return ref, captured, history


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_failures_and_resumes_follow_the_rules(tmp_path, monkeypatch, seed):
    _audit(tmp_path, monkeypatch, seed, runs=3)


# (seed 16 is not slow: with seeds 0-5 it catches each deliberate break of the audit's check, in a scratch copy)
@pytest.mark.parametrize("seed", [pytest.param(s, marks=() if s == 16 else pytest.mark.slow) for s in range(6, 30)])
def test_random_schedules_failures_and_resumes_follow_the_rules_long(tmp_path, monkeypatch, seed):
    _audit(tmp_path, monkeypatch, seed, runs=5)


@pytest.mark.parametrize("seed", [117, *(pytest.param(s, marks=pytest.mark.slow) for s in (118, 119))])
def test_an_export_of_a_random_kept_step_reads_back_to_its_weights(tmp_path, monkeypatch, seed):
    transformers = pytest.importorskip("transformers")
    from longctx.checkpoint.export import export_hf
    from longctx.models.hf import load_hf

    ref, captured, _ = _audit(tmp_path, monkeypatch, seed, runs=2)
    intact = sorted(n for n, d in ref.dirs.items() if d["damage"] is None and n != ref.moved)
    assert intact
    name = random.Random(seed).choice(intact)
    out, _, _, _ = export_hf(tmp_path / "checkpoints" / name, tmp_path / "hf")
    want = captured[ref.dirs[name]["call"]][0]
    ours = load_hf(out)
    for k, v in ours.state_dict().items():
        if k in want:
            assert torch.equal(v, want[k]), k
    assert set(want) <= set(ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4
    assert json.loads((out / "longctx_export.json").read_text())["step"] == ref.dirs[name]["step"]
