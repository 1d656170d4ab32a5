"""`longctx eval` holds one length's sequences at a time (eval/inputs.py LengthSequences), not every length's:
built when that length is evaluated and dropped before the next (at 1M tokens 25 passkey prompts are 400 MiB, on
every rank and in the launcher). Counted here as the bytes of the Sequence objects alive, found by the garbage
collector, when a length is scored or generated: exactly the bytes of the sequences being evaluated. And the
figures do not depend on it: a two-length run's results equal each length run alone, in either order."""

import gc
import sysconfig
from pathlib import Path

import pytest

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.eval import generate_mode, runner, score_mode
from longctx.eval.request import prepare
from longctx.eval.tasks import Sequence
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TINY = ["--model.preset=debug", "--model.layers=1", "--model.dim=32", "--model.heads=4", "--model.kv_heads=2",
        "--model.ffn_dim=64"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_and_text(tmp_path_factory.mktemp("held"))


def tiny_model_and_text(tmp):
    """(an hf:DIR of a random one-layer dim-32 model, ~60 KB of text), written in `tmp`."""
    hf = save_hf(build_model(load_config(overrides=TINY).model, seed=3), tmp / "hf")
    root = Path(sysconfig.get_paths()["stdlib"])
    text = tmp / "long.py"
    text.write_text("".join((root / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")))
    return hf, text


def _args(folder, task: str, lengths: str, *extra):
    hf, text = folder
    more = ["--samples", "2"] if task == "ppl" else ["--depths", "0,1", "--samples", "2"]
    return build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--data", str(text),
         "--lengths", lengths, *more, *extra])


def _alive() -> int:
    """The bytes of every Sequence object alive now."""
    gc.collect()
    return sum(o.tokens.nbytes + o.labels.nbytes for o in gc.get_objects() if type(o) is Sequence)


def _bytes(seqs) -> int:
    return sum(q.tokens.nbytes + q.labels.nbytes for q in seqs)


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_score_mode_holds_one_lengths_sequences(folder, monkeypatch, task):
    held, plain = [], runner.score

    def score(model, rt, seqs, *a, **k):
        held.append((_alive(), _bytes(seqs)))
        return plain(model, rt, seqs, *a, **k)
    monkeypatch.setattr(runner, "score", score)
    args, rest = _args(folder, task, "512,4096")
    request = prepare(args, rest, 1)
    after_prepare = _alive()
    score_mode.evaluate_score(request, args)
    assert len(held) == 2 and held[0][1] < held[1][1]
    for alive, scored in held:
        assert alive == scored  # the length being scored, no other (the sum of both before)
    assert after_prepare == 0  # (prepare checked each length and kept none)


def test_generate_mode_holds_one_lengths_sequences(folder, monkeypatch):
    held = []

    def answers(model, tokenizer, group, *a, **k):
        held.append(_alive())
        return ["0"] * len(group)
    monkeypatch.setattr(generate_mode, "_generate_answers", answers)
    args, rest = _args(folder, "passkey", "512,4096", "--mode", "generate")
    request = prepare(args, rest, 1)
    after_prepare = _alive()
    generate_mode.evaluate_generate(request, args)
    each = {n: _bytes(request.sequences[n]) for n in request.lengths}
    assert held == [each[512]] * 4 + [each[4096]] * 4  # (--batch 1: 2 depths x 2 samples per length)
    assert after_prepare == 0


def _figures(out: dict) -> list[dict]:
    """The results without their timings."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in out["results"]]


def _run(folder, task: str, lengths: str) -> list[dict]:
    args, rest = _args(folder, task, lengths)
    return _figures(score_mode.evaluate_score(prepare(args, rest, 1), args))


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_a_two_length_run_gives_each_lengths_figures_alone_and_in_either_order(folder, task):
    both, reverse = _run(folder, task, "512,4096"), _run(folder, task, "4096,512")
    alone = _run(folder, task, "512") + _run(folder, task, "4096")
    assert both == alone
    assert sorted(reverse, key=lambda r: r["length"]) == sorted(both, key=lambda r: r["length"])
    assert {r["length"] for r in both} == {512, 4096}
