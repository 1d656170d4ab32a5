"""Progress of long generation work (helper genprog113).

- a sharded prefill (generate/sharded.py) was one model call with no count: it now counts its prompt tokens layer
  by layer, timed by the layers' FLOPs (generate/prefill_progress.py; its two ranks in
  tests/distributed/test_genprog113_ranks.py);
- `eval --mode generate` counted whole sequences when a batch ended: a length's line sat at "0/2 sequences" through
  a sequence's prefill and its answer's tokens; now each sequence counts its prefill's share (following the
  prefill's own phase where it has one), then its new tokens, never going back, whole at its end
  (eval/generate_count.py), the answers unchanged;
- the prefill's FLOPs were a formula of its own in generate/local.py: now models/flops.py's (prefill_flops), the
  same figures; a change there (the layers' matmuls) reaches the prefill's time left.
Each test reads the running phases as a heartbeat would (no timing is asserted)."""

import time
from types import SimpleNamespace

import pytest
import torch

from longctx import progress
from longctx.config import load_config
from longctx.models import flops
from phase_spy import running_phases

DENSE, MOE = ["--model.preset=debug"], ["--model.preset=debug-moe", "--model.moe.dense_layers=0"]


@pytest.fixture(autouse=True)
def _speaking(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "20")  # (lines on; none is written: the work takes far less)
    monkeypatch.delenv("RANK", raising=False)


_running = running_phases


def _count(line: str) -> str:
    return line.split(": ")[1].split(" ")[0]


def _blocks_flops(cfg, tokens: float) -> float:
    """A causal forward over `tokens` positions through the blocks, by models/flops.py's forward figure (its
    LM head taken out: a prefill runs it on the last position only)."""
    return tokens * (flops.forward_flops_per_token(cfg, tokens) - 2 * cfg.dim * cfg.vocab_size)


# -- (c) one FLOP formula ----------------------------------------------------------------------------------


class _Chunks:
    """hidden_states / logits recording the running prefill phase's count and its weighed part at each chunk."""

    def __init__(self, cfg):
        self.cfg, self.seen = cfg, []

    def hidden_states(self, tokens, cache=None):
        phase = _running()[-1]
        self.seen.append((phase.done, phase.work(phase.done) if phase.work is not None else None))
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    def logits(self, hidden):
        return hidden


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("matmuls", [1, 10], ids=["as-built", "matmuls-x10"])
def test_the_prefills_time_left_is_timed_by_the_flops_modules_figures(shape, matmuls, monkeypatch):
    from longctx.generate.local import prefill
    from longctx.models.kv_cache import attend

    cfg = load_config(overrides=shape).model
    if matmuls != 1:  # (the flops module's layers made 10x heavier: the prefill's time left must follow it)
        real = flops.layer_matmul_params
        heavier = lambda c, active=False: [matmuls * p for p in real(c, active)]  # noqa: E731
        monkeypatch.setattr(flops, "layer_matmul_params", heavier)
    rows, length, chunk = 2, 10_000, 2_000
    model = _Chunks(cfg)
    prefill(model, SimpleNamespace(core=attend), torch.zeros(rows, length, dtype=torch.long), chunk)
    assert [done for done, _ in model.seen] == [rows * chunk * i for i in range(5)], model.seen
    for done, part in model.seen:
        want = _blocks_flops(cfg, done / rows) / _blocks_flops(cfg, length)
        assert part == pytest.approx(want, rel=1e-9, abs=1e-12), (done, part, want)
    assert model.seen[2][1] < 0.4 * (1 if matmuls == 1 else 1.25)  # (half the tokens: less than half the work)


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
def test_the_flops_modules_prefill_figures_are_its_forward_figures(shape):
    cfg = load_config(overrides=shape).model
    for tokens in (1, 100, 4096, 131_072):
        assert flops.prefill_flops(cfg, tokens) == pytest.approx(_blocks_flops(cfg, tokens), rel=1e-12)
        per_layer = flops.layer_prefill_flops(cfg, tokens)
        assert len(per_layer) == cfg.layers and sum(per_layer) == pytest.approx(_blocks_flops(cfg, tokens), rel=1e-12)


# -- (a) a sharded prefill's count, layer by layer ---------------------------------------------------------


class _Layered(torch.nn.Module):
    """A model of `layers` blocks whose one call records, as each block starts, the running phases' lines."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(cfg.layers)])
        self.seen = []

    def hidden_states(self, tokens):
        x = torch.zeros(tokens.shape[0], tokens.shape[1], 4)
        for layer in self.layers:
            phases = _running()
            self.seen.append((phases[-1].describe(time.monotonic()), phases[-1].done,
                              phases[-1].work(phases[-1].done) if phases and phases[-1].work else None))
            x = layer(x)
        return x


def _sharded_call(model, rows: int, length: int, chunk: int):
    from longctx.generate.prefill_progress import sharded_prefill_phase

    with sharded_prefill_phase(model, rows, length, chunk, 1, 2) as counts:
        counts.begin(rows * length)
        model.hidden_states(torch.zeros(rows, length // 2, dtype=torch.long))
        counts.end()
        return _running()[-1].done if _running() else None


@pytest.mark.parametrize("shape", [DENSE, MOE], ids=["dense", "moe"])
def test_a_sharded_prefills_one_call_is_counted_layer_by_layer_timed_by_its_layers_flops(shape):
    cfg = load_config(overrides=shape).model
    model = _Layered(cfg)
    rows, length = 1, 131_072
    with progress.phase("generate: 1 prompt of 131,072 tokens", total=16, unit="new tokens", done_line=False):
        done_at_end = _sharded_call(model, rows, length, 4096)
    lines = [line for line, _, _ in model.seen]
    assert all(line.startswith("prefill of 1 prompt of 131,072 tokens, sharded over head 1 x ctx 2 [")
               for line in lines), lines
    share = rows * length / cfg.layers
    assert [done for _, done, _ in model.seen] == [share * k for k in range(cfg.layers)], model.seen
    assert [_count(line) for line in lines] == [f"{share * k:,.0f}/131,072" for k in range(cfg.layers)]
    assert done_at_end == rows * length  # (whole when the call ends)
    # the part of the work done at each layer's start: the flops module's layers before it
    per_layer = flops.layer_prefill_flops(cfg, length)
    for k, (_, _, part) in enumerate(model.seen):
        assert part == pytest.approx(sum(per_layer[:k]) / sum(per_layer), rel=1e-9), (k, part)
    assert all(not layer._forward_hooks for layer in model.layers)  # (the hooks gone with the call)


def test_a_short_sharded_prefill_has_no_phase_of_its_own():
    model = _Layered(load_config(overrides=DENSE).model)
    with progress.phase("outer", done_line=False):
        _sharded_call(model, 2, 1000, 4096)
    assert all(line.startswith("outer [") for line, _, _ in model.seen), model.seen
    assert all(not layer._forward_hooks for layer in model.layers)


# -- (b) eval --mode generate: the count moves inside a sequence ---------------------------------------------

TINY = ["--model.preset=debug", "--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2",
        "--model.ffn_dim=64"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import sysconfig
    from pathlib import Path

    from longctx.models.hf import save_hf
    from longctx.models.llama import build_model

    tmp = tmp_path_factory.mktemp("genprog113")
    hf = save_hf(build_model(load_config(overrides=TINY).model, seed=3), tmp / "hf")
    text = tmp / "long.py"
    root = Path(sysconfig.get_paths()["stdlib"])
    text.write_text("".join((root / name).read_text() for name in ("textwrap.py", "shlex.py")))
    return hf, text


def _evaluate(folder, monkeypatch, seen: list | None) -> dict:
    """eval --task passkey --mode generate at 512 tokens, 2 sequences one at a time; with `seen`, each new
    token's length phase recorded there (the phase and its count then) as a heartbeat would read it."""
    from longctx.cli import build_parser
    from longctx.eval import generate_mode
    from longctx.eval.request import prepare
    from longctx.generate import loop

    if seen is not None:
        real = loop._Book._token

        def token(self, r, tok, logprob, top):
            ended = real(self, r, tok, logprob, top)
            length = next(p for p in _running() if p.unit == "sequences")
            seen.append((length, length.done, len(self.tokens[r]), ended))
            return ended
        monkeypatch.setattr(loop._Book, "_token", token)
    hf, text = folder
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", "passkey", "--data", str(text),
         "--lengths", "512", "--depths", "0,1", "--samples", "1", "--mode", "generate"])
    return generate_mode.evaluate_generate(prepare(args, rest, 1), args)


def test_eval_generate_counts_inside_each_sequence_never_back_and_whole_at_its_end(folder, monkeypatch):
    seen = []
    out = _evaluate(folder, monkeypatch, seen)
    phase = seen[0][0]
    assert all(p is phase for p, *_ in seen) and phase.total == 2
    counts = [done for _, done, _, _ in seen]
    assert counts == sorted(counts), counts  # never back
    ends = [i for i, (_, _, _, ended) in enumerate(seen) if ended]
    assert len(ends) == 2, seen  # (one row per batch: each sequence ends once)
    first = counts[:ends[0] + 1]
    assert 0 < first[0] < 1 and len(set(first)) == len(first) and first[-1] <= 1, first  # moves within it
    second = counts[ends[0] + 1:]
    assert 1 <= second[0] < 2 and len(set(second)) == len(second), second  # from whole after the first
    assert phase.done == 2  # whole at the end
    assert "0/2" not in phase.describe(time.monotonic())
    assert sum(r["samples"] for r in out["results"]) == 2


def test_eval_generates_count_follows_a_long_prefills_phase_then_its_tokens():
    """One sequence of a 3,000-token prompt prefilled in chunks of 1,000 (its own phase): the length's count moves
    with the prefill's prompt tokens, then with each new token, and ends whole."""
    from longctx.eval.generate_count import SequenceCount
    from longctx.generate.engine import generate
    from longctx.models.llama import build_model

    model = build_model(load_config(overrides=TINY).model, seed=3).eval()
    seen = []

    def layer_starts(module, _args):  # (each model call: a prefill chunk, or a decode step)
        phases = _running()
        line = phases[0].describe(time.monotonic())  # (as a heartbeat says it: the count read then)
        seen.append((len(phases), phases[0].done, line))

    hook = model.layers[0].register_forward_pre_hook(layer_starts)
    try:
        with progress.phase("3,000 tokens", 1, "sequences", done_line=False) as length:
            count = SequenceCount(length, model.cfg)
            count.begin([3000], [12])
            out = generate(model, [[7] * 3000], max_new_tokens=12, prefill_chunk=1000, on_token=count.on_token)
            count.end(out)
            assert length.done == 1
    finally:
        hook.remove()
    prefill = [done for inside, done, _ in seen if inside == 2]
    decode = [done for inside, done, _ in seen if inside == 1]
    assert len(prefill) == 3 and prefill[0] == 0 and 0 < prefill[1] < prefill[2] < 1, seen
    assert len(decode) == 11 and prefill[2] < decode[0] and decode == sorted(set(decode)) and decode[-1] < 1, seen
    assert [line.split(": ")[1].split(" ")[0] for _, _, line in seen][:2] == ["0/1", f"{prefill[1]:.1f}/1"]


def test_eval_generate_answers_are_the_same_with_and_without_progress_lines(folder, monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    quiet = _evaluate(folder, monkeypatch, None)
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.05")
    speaking = _evaluate(folder, monkeypatch, None)
    for a, b in zip(quiet["results"], speaking["results"], strict=True):
        assert (a["generated"], a["per_sample"]) == (b["generated"], b["per_sample"])
    assert quiet["results"][0]["generated"][0]  # (something was generated)
