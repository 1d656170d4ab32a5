"""Small defects found late in session 117: a build whose records lack --text-field said to point --input at other
data (and a dotted --text-field was a literal key only); the spike check's median at an even window; the
generation-time RoPE change's position count for a non-integer factor; a checkpoint written before a schedule key
existed resumed under another shape without a note."""

import json
import random

import pytest

from longctx.data.builder.inputs import read_inputs
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.errors import DataError


def _opts(inputs, out, **kw):
    return BuildOptions(inputs=[str(i) for i in inputs], out=str(out), seq_len=256, progress=False, workers=1, **kw)


def _quiet(*_):
    pass


def _words(rng, n=120):
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "omega"]) for _ in range(n))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- 1. records without the --text-field ----------------------------------------------------------------------------

def test_missing_text_field_names_the_fields_records_have(tmp_path):
    rng = random.Random(0)
    data = _jsonl(tmp_path / "a.jsonl", [{"content": _words(rng), "id": i} for i in range(6)])
    with pytest.raises(DataError) as e:
        build_store(_opts([data], tmp_path / "out"), log=_quiet)
    msg = str(e.value)
    assert "6 no text field" in msg
    assert "content, id" in msg and "--text-field NAME" in msg
    assert "Point --input at" not in msg


def test_a_non_string_text_field_is_named_as_such(tmp_path):
    rng = random.Random(1)
    data = _jsonl(tmp_path / "a.jsonl", [{"text": [_words(rng)]} for _ in range(3)])
    with pytest.raises(DataError, match=r"no string under 'text' \(--text-field; .*list"):
        build_store(_opts([data], tmp_path / "out"), log=_quiet)


def test_other_skips_keep_the_input_advice(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("   ")
    with pytest.raises(DataError, match="Point --input at"):
        build_store(_opts([tmp_path / "d"], tmp_path / "out"), log=_quiet)


def test_dotted_text_field_reads_nested_json_and_a_literal_key_wins(tmp_path):
    rng = random.Random(2)
    nested = [{"meta": {"body": _words(rng)}, "id": i} for i in range(4)]
    literal = [{"meta.body": "LITERAL " + _words(rng), "meta": {"body": "NESTED " + _words(rng)}}]
    data = _jsonl(tmp_path / "a.jsonl", nested + literal)
    read = read_inputs([str(data)], text_field="meta.body")
    assert [d.text for d in read.docs] == [r["meta"]["body"] for r in nested] + [literal[0]["meta.body"]]
    build_store(_opts([data], tmp_path / "out", text_field="meta.body"), log=_quiet)  # (a build reads them too)
    from longctx.data.builder.readers import field_value  # (here: a module missing it fails this test alone)
    assert field_value(nested[0], "meta.nope") is None and field_value({"meta": "x"}, "meta.body") is None
    # and a record whose nested field is missing says which dotted fields there are
    bad = _jsonl(tmp_path / "b.jsonl", [{"meta": {"content": _words(rng)}} for _ in range(3)])
    with pytest.raises(DataError, match=r"meta, meta\.content"):
        build_store(_opts([bad], tmp_path / "out2", text_field="meta.body"), log=_quiet)


def test_a_dotted_field_in_parquet_says_how_to_flatten(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"meta": [{"body": "some text here"}]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"no column 'meta\.body'.*Table\.flatten\(\)"):
        build_store(_opts([tmp_path / "a.parquet"], tmp_path / "out", text_field="meta.body"), log=_quiet)


# -- 2. the spike check's median at an even window --------------------------------------------------------------------

def test_spike_check_uses_the_usual_median_at_an_even_window():
    import torch

    from longctx.train.guard import StepGuard
    guard = StepGuard(spike_factor=2.0, spike_window=4, device=torch.device("cpu"))
    for loss in (1.0, 2.0, 4.0, 10.0):  # median (2 + 4) / 2 = 3: threshold 6; the lower middle value's: 4
        guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
    ok, spike = guard.check(torch.tensor(5.0, dtype=torch.float64), torch.tensor(1.0))
    assert (bool(ok), bool(spike)) == (True, False)  # 5 <= 2 x 3: no spike, though over 2 x 2
    ok, spike = guard.check(torch.tensor(8.5, dtype=torch.float64), torch.tensor(1.0))  # window 2,4,10,5: 4.5 -> 9
    assert (bool(ok), bool(spike)) == (True, False)
    ok, spike = guard.check(torch.tensor(14.0, dtype=torch.float64), torch.tensor(1.0))  # 4,10,5,8.5: 6.75 -> 13.5
    assert (bool(ok), bool(spike)) == (False, True)


def test_spike_check_median_at_an_odd_window_is_the_middle_value():
    import torch

    from longctx.train.guard import StepGuard
    guard = StepGuard(spike_factor=2.0, spike_window=3, device=torch.device("cpu"))
    for loss in (1.0, 3.0, 10.0):  # median 3: threshold 6
        guard.check(torch.tensor(loss, dtype=torch.float64), torch.tensor(1.0))
    assert [bool(x) for x in guard.check(torch.tensor(6.5, dtype=torch.float64), torch.tensor(1.0))] == [False, True]
    assert [bool(x) for x in guard.check(torch.tensor(6.0, dtype=torch.float64), torch.tensor(1.0))] == [True, False]


# -- 3. the length a linear RoPE scaling's weights learned, for a non-integer factor --------------------------------

def test_unscaled_positions_of_a_linear_scaling_is_not_one_short():
    import dataclasses

    from longctx.config.positions import Reach, covered_positions, idle_original, unscaled_positions
    from longctx.config.schema import ModelConfig
    own = dataclasses.replace(ModelConfig(), rope_scaling="linear", rope_factor=3.3)
    trained = 13516  # a config.json's max_position_embeddings 4,096 x 3.3, as longctx reads it (int(13,516.8))
    assert unscaled_positions(own, trained) == 4096
    # the scaling dropped at generation time: the 4,096 positions the weights learned, not 4,095
    assert covered_positions(dataclasses.replace(own, rope_scaling="none", rope_factor=1.0), own, trained) == 4096
    # a yarn x 4 over the 4,096 they learned stretches them (it was "past the 4,095 learned unscaled": idle)
    yarn = dataclasses.replace(own, rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=4096)
    assert idle_original(yarn, own, trained) == 0
    assert covered_positions(yarn, own, trained) == 16384
    reach = Reach(13516, trained, unscaled_positions(own, trained), "test")
    assert "--model.rope_original_max_len=4096" in reach.extension_flags(20000)
    # an integer factor was right before and stays so; a length that is no stretch of a whole one rounds down
    assert unscaled_positions(dataclasses.replace(own, rope_factor=4.0), 16384) == 4096
    assert unscaled_positions(own, 13519) == 4096  # 4,097 x 3.3 = 13,520.1: past it


# -- 4. a saved schedule_state without a key added later --------------------------------------------------------------

def _train_cfg(*overrides):
    from longctx.config import load_config
    return load_config(None, ["--train.lr=0.003", "--train.steps=100", "--train.warmup_steps=10", *overrides])


def _old_state():
    """A schedule_state as a checkpoint written before lr_schedule and lr_decay_fraction existed would hold it
    (by hand: the run was a cosine over every step after its warmup)."""
    return {"lr": 0.003, "steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1}


@pytest.mark.parametrize("change", ["--train.lr_schedule=linear", "--train.lr_decay_fraction=0.5",
                                    "--train.lr_schedule=constant"])
def test_a_state_saved_before_a_schedule_key_compares_with_the_old_schedule(change):
    import math

    from longctx.step.schedule import resume_note
    cfg = _train_cfg(change)
    step = 60  # (0-based: the trainer's step 61) after the warmup, inside every decay
    progress = (step - 10) / (100 - 10 - 1)  # the old cosine, written here from its formula
    old_rate = 0.003 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    note = resume_note(_old_state(), cfg, step)
    assert note is not None and f"give {old_rate:.3g}" in note
    key = change[len("--train."):].split("=")[0]
    assert f"train.{key} " in note and "not saved" in note


def test_a_state_saved_before_a_schedule_key_under_the_old_schedule_gives_no_note():
    from longctx.step.schedule import BEFORE_KEYS, SCHEDULE_KEYS, resume_note
    assert resume_note(_old_state(), _train_cfg(), 60) is None  # (cosine, decay fraction 1: the defaults)
    # every key is in every state saved (the first four) or names the schedule before it
    assert set(SCHEDULE_KEYS) == set(_old_state()) | set(BEFORE_KEYS)
