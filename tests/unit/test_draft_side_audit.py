"""Regressions of the draft-side audit (2026-12-02): GliDe / Clover drafts under Ms-PoE, a data mix's
reduced vocabulary, inert draft settings refused, the default draft window under train.stages, bench
decode's reported window. Uses test_glide_training's tiny target and trained draft."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_glide_training import (  # noqa: E402,F401
    QUIET,
    _draft_run,
    _target_model,
    corpus,
    target,
    trained,
    word_documents,
)

from longctx.checkpoint.glide import glide_manifest, load_glide_draft, target_differences  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402


def _generate(checkpoint, out, *extra):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare, run

    argv = ["generate", "--checkpoint", str(checkpoint), "--prompt", "def return self import ", "--max-new-tokens",
            "12", "--output", str(out), "--model.rope_ms_poe=true", "--model.rope_ms_poe_skip_layers=1", *extra]
    args, rest = build_parser("generate").parse_known_args(argv)
    args.argv = argv[1:]
    run(prepare(args, rest), args)
    return json.loads(out.read_text())["tokens"]


@pytest.mark.parametrize("cape", [[], ["--cape"]])
def test_a_draft_drafts_for_its_target_under_ms_poe_and_stays_lossless(trained, target, tmp_path, cape):  # noqa: F811
    """docs/generate.md: a GliDe draft reads the target's cache with plain positions under Ms-PoE (its
    acceptance may drop; verification keeps decoding lossless). Ms-PoE's fields (generate / eval only)
    were compared as the target's model config, so every draft was refused under --model.rope_ms_poe."""
    _, _, checkpoints = trained
    model, _ = _target_model(target)
    poe = dataclasses.replace(model.cfg, rope_ms_poe=True, rope_ms_poe_skip_layers=1)
    record = glide_manifest(checkpoints)
    assert target_differences(record, poe) == []
    assert target_differences(record, dataclasses.replace(poe, ffn_dim=256))  # (what it computes still counts)
    plain = _generate(target, tmp_path / "plain.jsonl")
    assert len(plain) == 12
    assert _generate(target, tmp_path / "spec.jsonl", "--draft", str(checkpoints), *cape) == plain


def test_inert_draft_settings_are_refused_before_work(target, tmp_path):  # noqa: F811
    """draft.kd_temperature tempers the distillation only (with draft.loss = ce it changed nothing, and the
    record kept it); a draft.block not below train.seq_len leaves every position in the first block, reading
    no target key; --draft-window is a GliDe / Clover draft's prompt window (a plain draft model read the
    whole prompt, the flag ignored)."""
    draft = [f"--draft.target={target}", "--train.seq_len=64"]
    with pytest.raises(ConfigError, match="does nothing with draft.loss = ce"):
        load_config(None, [*draft, "--draft.loss=ce", "--draft.kd_temperature=4"])
    with pytest.raises(ConfigError, match="draft.block = 64 is not below train.seq_len = 64"):
        load_config(None, [*draft, "--draft.block=64"])
    assert load_config(None, [*draft, "--draft.loss=kd", "--draft.kd_temperature=4", "--draft.block=63"])
    with pytest.raises(ConfigError, match="--draft-window 3 is the prompt window of a GliDe or Clover draft"):
        _generate(target, tmp_path / "out.jsonl", "--draft", str(target), "--draft-window", "3")


def test_an_early_stage_checkpoints_draft_window_is_the_length_it_trained_on(corpus, target, tmp_path):  # noqa: F811
    """Under train.stages a draft's record held the last stage's seq_len, which decoding takes as the default
    --draft-window: a checkpoint of the first stage (32 tokens) said 64."""
    from longctx.train.trainer import Trainer

    quiet = [a for a in QUIET if not a.startswith("--train.seq_len")]  # (the stages say the lengths)
    Trainer(load_config(None, [*quiet, *corpus, f"--draft.target={target}", f"--train.run_dir={tmp_path}",
                               "--train.stages=32:2,64:2", "--checkpoint.interval=2", "--train.global_batch=2"]),
            log=lambda *a, **k: None).run()
    model, _ = _target_model(target)
    steps = tmp_path / "checkpoints"
    assert [load_glide_draft(steps / s, model, "cpu").trained_seq_len
            for s in ("step-00000002", "step-00000004")] == [32, 64]


def test_a_reduced_vocabulary_is_counted_over_a_data_mix(corpus, target, tmp_path):  # noqa: F811
    """draft.vocab with data.path = 'A,B': each store's counts per train sample, weighted by data.weights (shares of
    samples), the tokens the run trains on (it opened 'A,B' as one store and failed after loading the target)."""
    from longctx.data.loader import PackedSamples
    from longctx.train.glide import token_counts
    from longctx.train.setup import store_path

    (tmp_path / "other").mkdir()
    other = word_documents(tmp_path / "other", 80, 20)
    quiet = lambda *a, **k: None  # noqa: E731
    stores = [store_path(load_config(None, [*QUIET, *c]), quiet, None) for c in (corpus, other)]
    mix = [f"--data.path={','.join(stores)}", "--data.weights=0.25,0.75", "--data.tokenizer=byte",
           "--draft.vocab=30", "--train.steps=1"]
    trainer, result = _draft_run([], target, tmp_path / "run", *mix)
    assert len(result.losses) == 1
    counts = token_counts(trainer.cfg, trainer.rt, quiet)
    alone = []
    for store in stores:
        samples = PackedSamples(store, "train", True)
        c = torch.zeros(trainer.cfg.model.vocab_size, dtype=torch.float64)
        for i in range(len(samples)):
            tokens, labels, _, _ = samples.sample(i)
            real = sum(int(n) for _, _, n, _, _ in samples.segments(i).tolist())
            c += torch.bincount(torch.as_tensor(tokens[:real]).long(), minlength=c.numel()).double()
        alone.append(c / len(samples))  # (a weight is a share of the samples: a store's tokens per sample)
    assert torch.allclose(counts.double(), 0.25 * alone[0] + 0.75 * alone[1], rtol=1e-9, atol=1e-12)


def test_a_stage_no_longer_than_the_block_is_refused_as_a_short_sequence_is(target):  # noqa: F811
    """train.stages: a stage of draft.block tokens or fewer trains its steps with every position in the first
    block, reading no target key, as train.seq_len = block would (refused); the stages were not looked at."""
    draft = [f"--draft.target={target}", "--draft.block=4"]
    with pytest.raises(ConfigError, match="not below the shortest stage's 4 tokens"):
        load_config(None, [*draft, "--train.stages=4:2,64:2"])
    assert load_config(None, [*draft, "--train.stages=5:2,64:2"]).train.stages == "5:2,64:2"
