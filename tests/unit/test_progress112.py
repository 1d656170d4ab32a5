"""Long phases whose counts did not move (progress audit, second round): each now counts inside the work.

Measured before, stderr to a file on a loaded 2-core machine: `longctx data build` of one 131 MB JSONL file said
"0/131 MB" until the file was done (a shard's count moved when it was done); `longctx generate` of a 32K-token
prompt said its prompts' phase with no count of the prefill's chunks; `longctx eval` of one long sequence said a
time left that grew while the sequence was scored (done / elapsed with done 0 until it ended); `longctx generate`'s
model load said nothing (16 s for a 100M checkpoint here, minutes for an 8B one). Each test records the running
phase part-way through the work (no timing is asserted) and reads its line as a heartbeat would write it."""

import json
import multiprocessing as mp
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_data_build_audit import opts, quiet  # noqa: E402
from test_newcomer import longctx_here  # noqa: E402

import longctx.train.trainer as trainer_module  # noqa: E402
from longctx import progress  # noqa: E402
from longctx.checkpoint import manifest as manifest_module  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.data.builder import readers, scan, scan_pool  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.eval.runner import score  # noqa: E402
from longctx.eval.tasks import Sequence  # noqa: E402
from longctx.generate.local import prefill  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from phase_spy import running_phases


@pytest.fixture(autouse=True)
def _speaking(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "20")  # (lines on; none is written: the work takes far less)
    monkeypatch.delenv("RANK", raising=False)


_running = running_phases


def _jsonl(path: Path, docs: int, seed: int) -> int:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "long", "context", "token", "river", "stone", "cloud"]
    path.write_text("".join(json.dumps({"text": f"[{seed}.{i}] " + " ".join(rng.choices(words, k=40))}) + "\n"
                            for i in range(docs)))
    return path.stat().st_size


# -- 1. data build: a file counted as it is read ----------------------------------------------------------


@pytest.fixture
def small_reads(monkeypatch):
    monkeypatch.setattr(readers, "CHUNK", 4096)  # (a file of 1 MB chunks fits in one read: counted whole at once)
    try:  # (each document reports: no waiting for a second)
        from longctx.data.builder import scan_progress
        monkeypatch.setattr(scan_progress, "REPORT_S", 0.0)
    except ImportError:  # (a tree before the count within a file: nothing to set, and the test fails below)
        pass


def test_one_big_file_scanned_in_this_process_is_counted_as_it_is_read(tmp_path, monkeypatch, small_reads):
    (tmp_path / "in").mkdir()
    size = _jsonl(tmp_path / "in" / "big.jsonl", 1500, seed=1)
    seen, mb, real_add = [], [], scan.ShardFiles.add

    def add(self, doc, tok):
        if self.n % 100 == 50:  # (the scan stage's phase, said as a heartbeat would say it now, and its count)
            phase = progress.current()
            seen.append(phase.describe(time.monotonic()))
            mb.append(phase.done)
        return real_add(self, doc, tok)

    monkeypatch.setattr(scan.ShardFiles, "add", add)
    build_store(opts([tmp_path / "in"], tmp_path / "out"), log=quiet)
    assert len(seen) == 15, seen
    percent = [int(line.split("(")[1].split("%")[0]) for line in seen]
    assert all(line.startswith("scan [") and line.endswith("left") for line in seen[1:]), seen
    assert f"/{size / 1e6:,.1f} MB (" in seen[-1], (size, seen)
    assert 0 < mb[1] < mb[7] < mb[-1] < size / 1e6, mb  # (it moves while the one file is read)
    assert 0 < percent[1] < percent[7] < percent[-1] < 100, seen


def test_shards_scanned_by_worker_processes_are_counted_as_they_are_read(tmp_path, monkeypatch, small_reads):
    monkeypatch.setattr(scan_pool, "worker_context", lambda: mp.get_context("fork"))  # (the patches reach them)
    monkeypatch.setattr(scan, "SHARD_BYTES", 1000)  # one file a shard
    (tmp_path / "in").mkdir()
    sizes = [_jsonl(tmp_path / "in" / f"f{i}.jsonl", 800, seed=i) for i in range(2)]
    part_way, go = mp.get_context("fork").Barrier(3), mp.get_context("fork").Event()
    real_add = scan.ShardFiles.add

    def add(self, doc, tok):
        if self.n == 400:  # half-way through each worker's file: both wait here until the parent has looked
            part_way.wait(timeout=60)
            go.wait(timeout=60)
        return real_add(self, doc, tok)

    monkeypatch.setattr(scan.ShardFiles, "add", add)
    said = []

    def look():  # (in the parent, while its main thread waits for the workers)
        part_way.wait(timeout=60)
        phases = _running()
        said.append(phases[-1].describe(time.monotonic()) if phases else "no phase")
        go.set()

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    build_store(opts([tmp_path / "in"], tmp_path / "out", workers=2), log=quiet)
    watcher.join(timeout=60)
    assert len(said) == 1 and said[0].startswith("scan ["), said
    done = float(said[0].split(": ")[1].split("/")[0])
    assert 0.25 * sum(sizes) / 1e6 < done < 0.75 * sum(sizes) / 1e6, (sizes, said)  # both files about half read
    assert said[0].endswith("left"), said


# -- 2. generate: a chunked prefill counts its chunks ----------------------------------------------------


class _Model:
    """hidden_states / logits that record the running phases at each chunk (the prefill's own model calls)."""

    def __init__(self):
        self.seen = []

    def hidden_states(self, tokens, cache=None):
        self.seen.append([p.describe(time.monotonic()) for p in _running()])
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    def logits(self, hidden):
        return hidden


def test_a_chunked_prefill_counts_its_prompt_tokens_chunk_by_chunk():
    model = _Model()
    with progress.phase("generate: 1 prompt of 10,000 tokens", total=16, unit="new tokens", done_line=False):
        prefill(model, None, torch.zeros(1, 10_000, dtype=torch.long), 4096)
    assert len(model.seen) == 3, model.seen
    inner = [seen[-1] for seen in model.seen]
    assert all(s.startswith("prefill of 1 prompt of 10,000 tokens, in chunks of 4,096 [") for s in inner), inner
    assert [s.split(": ")[1].split(" prompt")[0] for s in inner] == ["0/10,000", "4,096/10,000", "8,192/10,000"]
    assert inner[1].endswith("left"), inner
    assert all(len(seen) == 2 and seen[0].startswith("generate: 1 prompt") for seen in model.seen), model.seen
    short = _Model()  # (one chunk: no phase of its own)
    prefill(short, None, torch.zeros(2, 100, dtype=torch.long), 4096)
    assert short.seen == [[]], short.seen


def test_a_chunk_of_a_prefill_is_counted_layer_by_layer_as_it_runs():
    class Layered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
            self.between = []

        def hidden_states(self, tokens, cache=None):
            x = self.layers[0](torch.zeros(tokens.shape[0], tokens.shape[1], 4))
            self.between.append(_running()[-1].describe(time.monotonic()))  # (after the first of two layers)
            return self.layers[1](x)

        def logits(self, hidden):
            return hidden

    model = Layered()
    prefill(model, None, torch.zeros(1, 6000, dtype=torch.long), 4096)
    counts = [line.split(": ")[1].split(" prompt")[0] for line in model.between]
    assert counts == ["2,048/6,000", "5,048/6,000"], model.between  # (half of each chunk: 4,096, then 1,904)
    assert all(not layer._forward_hooks for layer in model.layers)  # (the hooks gone with the prefill)


def test_a_prefills_time_left_is_timed_by_its_flops_so_later_chunks_do_not_push_it_back():
    """On a clock where the prefill's time follows its FLOPs (counted here from the built model's weights: 2 per
    matmul weight per token, and 4 per key and query dimension for QK^T and PV), each line's elapsed time plus
    its time left is the prefill's whole time; counted in tokens alone, the first lines promised far less."""
    from longctx.models.kv_cache import attend

    cfg = load_config(None, ["--train.device=cpu"]).model
    layers = build_model(cfg).layers
    per_token = 2 * sum(p.numel() for p in layers.parameters() if p.dim() == 2)
    per_key = 4 * cfg.layers * cfg.heads * (cfg.head_dim or cfg.dim // cfg.heads)
    length, chunk = 32_000, 4096
    flops = lambda t: per_token * t + per_key * t * t / 2  # noqa: E731
    whole_s = 3600.0
    seen = []

    class Model(_Model):
        def hidden_states(self, tokens, cache=None):
            phase = _running()[-1]
            done = phase.done
            seen.append((phase.describe(phase.started + whole_s * flops(done) / flops(length)), done))
            return super().hidden_states(tokens, cache)

    model = Model()
    model.cfg = cfg
    prefill(model, SimpleNamespace(core=attend), torch.zeros(1, length, dtype=torch.long), chunk)
    assert len(seen) == 8, seen
    for line, done in seen[1:]:
        left = _seconds(line.rsplit("about ", 1)[1].removesuffix(" left"))
        assert abs(left - whole_s * (1 - flops(done) / flops(length))) <= 60, (line, done)


# -- 3. eval: a long sequence counted layer by layer -------------------------------------------------------


def test_a_long_sequence_is_counted_layer_by_layer_so_its_time_left_does_not_grow():
    cfg = load_config(None, ["--train.device=cpu"])
    model = build_model(cfg.model).eval()
    rt = SimpleNamespace(mesh=None, dp=1, dp_rank=0, sum_tensor=lambda t: t)
    length = 64
    seqs = [Sequence(np.arange(length) % 200, np.arange(length) % 200, length)]
    seen = []

    def layer_starts(module, _args):  # (a heartbeat as each layer starts, on a clock where each layer takes 10 s)
        k = layers.index(module)
        seen.append(phase.describe(100.0 + 10.0 * k))

    layers = list(model.layers)
    hooks = [layer.register_forward_pre_hook(layer_starts) for layer in layers]
    try:
        with progress.phase("ppl at 64 tokens", 1, "sequences", done_line=False) as phase:
            phase.started = 100.0
            score(model, rt, seqs, 1, 4, torch.device("cpu"), None, phase)
            assert phase.done == 1, phase.done
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(layers) >= 2, seen
    counts = [line.split(": ")[1].split(" sequences")[0] for line in seen]
    assert counts[0] == "0/1" and len(set(counts)) == len(counts), counts  # (a part of the one sequence)
    # the layers and the LM head (one part more) at 10 s each: elapsed + time left is their whole time, each line
    whole = 10 * (len(layers) + 1)
    for k, line in enumerate(seen[1:], start=1):
        left = line.rsplit("about ", 1)[1].removesuffix(" left")
        assert f"[{10 * k}s]" in line and _seconds(left) == whole - 10 * k, (whole, seen)


def _seconds(text: str) -> int:
    """'45s', '1m20s' or '1h02m' -> seconds."""
    if "h" in text:
        hours, _, minutes = text.partition("h")
        return int(hours) * 3600 + int(minutes.removesuffix("m")) * 60
    minutes, _, rest = text.rpartition("m")
    return int(minutes or 0) * 60 + int(rest.removesuffix("s"))


# -- 4. generate: the model's load is a phase, its checksums counted -------------------------------------


def test_generates_model_load_is_a_phase_that_counts_the_checksums_read(tmp_path, monkeypatch):
    run = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
           "--metrics.plots=false", "--train.device=cpu", f"--train.run_dir={tmp_path / 'r'}", "--train.steps=1"]
    trainer_module.Trainer(load_config(None, run), log=lambda *a, **k: None).run()
    seen, real = [], manifest_module.file_problem

    def file_problem(directory, entry, checksums=True, *a, **kw):
        seen.append((entry["bytes"], [(p.what, p.done, p.total) for p in _running()]))
        return real(directory, entry, checksums, *a, **kw)

    monkeypatch.setattr(manifest_module, "file_problem", file_problem)
    checkpoints = tmp_path / "r" / "checkpoints"
    r = longctx_here("generate", "--checkpoint", str(checkpoints), "--prompt", "def f(x):", "--max-new-tokens", "2",
                     "--ignore-eos")
    assert r.returncode == 0, r.stderr
    loads = [(n, phases) for n, phases in seen if phases and phases[0][0].startswith("generate: loading the model")]
    assert len(loads) >= 3, seen  # (the checkpoint's files, each checked while the model loads)
    outer, inner = loads[0][1][0], loads[0][1][-1]
    assert outer[0] == f"generate: loading the model from {checkpoints} (step 1)", outer
    assert inner[0].startswith("checkpoint: verifying the checksums of ") and inner[2] > 0, inner
    before = [phases[-1][1] for _, phases in loads]  # MB counted before each file
    assert before[0] == 0 and all(a < b for a, b in zip(before, before[1:])) and before[-1] < inner[2], before
    assert abs(before[-1] + loads[-1][0] / 1e6 - inner[2]) < 1e-6, (before, loads[-1][0], inner)


def test_a_runs_init_from_load_is_two_phases(tmp_path, monkeypatch):
    """model.init_from (and eval's load: checkpoint/weights_only.py load_weights_into) verified and read the
    checkpoint in silence, as generate's load did: minutes each for an 8B model."""
    from longctx.checkpoint import counted_read
    from longctx.checkpoint import manager as manager_module

    run = ["--train.seq_len=64", "--train.global_batch=2", "--data.max_docs=40", "--train.eval_interval=0",
           "--metrics.plots=false", "--train.device=cpu", "--train.steps=1"]
    quiet_log = lambda *a, **k: None  # noqa: E731
    trainer_module.Trainer(load_config(None, run + [f"--train.run_dir={tmp_path / 'a'}"]), log=quiet_log).run()
    seen = []
    real_find, real_load = manager_module.CheckpointManager._find_damage, counted_read.dcp.load

    def find_damage(self, path, progress):  # (the checks themselves, inside find_damage's phase)
        seen.append(("verify", [p.what for p in _running()]))
        return real_find(self, path, progress)

    def load(*a, **kw):
        seen.append(("read", [p.what for p in _running()]))
        return real_load(*a, **kw)

    monkeypatch.setattr(manager_module.CheckpointManager, "_find_damage", find_damage)
    monkeypatch.setattr(counted_read.dcp, "load", load)
    step = tmp_path / "a" / "checkpoints" / "step-00000001"
    trainer_module.Trainer(load_config(None, run + [f"--train.run_dir={tmp_path / 'b'}", f"--model.init_from={step}"]),
                           log=quiet_log).run()
    assert [kind for kind, _ in seen] == ["verify", "read"], seen
    assert seen[0][1][-1] == f"checkpoint: verifying the checksums of {step}", seen
    assert seen[1][1][-1] == f"checkpoint: reading {step}", seen
