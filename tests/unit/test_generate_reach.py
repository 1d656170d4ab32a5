"""The prompt-length guard of `longctx generate` (config/positions.py): a prompt is checked against
the positions the weights were trained on (a checkpoint's recorded trained_positions, a Hugging Face
model's max_position_embeddings) stretched only by a RoPE scaling, never by --model.max_seq_len.
Past it: refused, or with --allow-extrapolation run with a note. Training records the positions."""

import json

import pytest

transformers = pytest.importorskip("transformers")
import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

from longctx.checkpoint.manifest import read_manifest, write_manifest  # noqa: E402
from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.hf import model_config  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.config.positions import covered_positions, scaled_reach  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.generate.cli import prepare  # noqa: E402

PROMPT = "x " * 100  # 101 BPE tokens: past 64 positions


def _model(**fields):
    return model_config({"rope_scaling": "none", "rope_factor": 8.0, "rope_original_max_len": 8192, **fields})


def test_covered_positions_by_hand():
    none = _model()
    assert covered_positions(none, none, 64) == 64
    assert covered_positions(_model(max_seq_len=4096), none, 64) == 64  # max_seq_len moves nothing
    yarn = _model(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=64)
    assert scaled_reach(yarn) == 256 and covered_positions(yarn, yarn, 64) == 256  # the weights' own scaling
    assert covered_positions(yarn, none, 64) == 256  # a scaling added at generation: 64 x 4
    # original (8,192) past what the weights learned (64): the scaling stretches nothing (test below)
    assert covered_positions(_model(rope_scaling="yarn", rope_factor=4.0), none, 64) == 64
    assert covered_positions(_model(rope_scaling="linear", rope_factor=2.0), none, 64) == 128
    extended = _model(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=512)
    assert covered_positions(extended, extended, 1024) == 2048  # trained at 1024, yarn reaches 2048
    wider = _model(rope_scaling="yarn", rope_factor=8.0, rope_original_max_len=512)
    assert covered_positions(wider, extended, 1024) == 4096  # the factor raised: 512 x 8


@pytest.fixture
def hf64(tmp_path):
    """A weightless Hugging Face Llama trained (as its config says) on 64 positions."""
    def make(**extra):
        d = tmp_path / f"hf{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(test_hf.hf_config("llama", max_position_embeddings=64, **extra)))
        bpe_tokenizer(d / "tokenizer.json")
        return d
    return make


def _prepare(*argv):
    args, rest = build_parser("generate").parse_known_args(["generate", *argv])
    return prepare(args, rest)


def test_raising_max_seq_len_does_not_pass_the_guard(hf64):
    d = hf64()
    with pytest.raises(ConfigError) as e:
        _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--model.max_seq_len=4096")
    said = " ".join(str(e.value).split())
    assert "past the 64 positions the model reaches (trained on 64: its config.json's max_position_embeddings)" \
        in said and "--allow-extrapolation" in said and "--model.rope_scaling=yarn" in said


def test_allow_extrapolation_runs_with_one_note(hf64):
    d = hf64()
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--model.max_seq_len=4096",
                    "--allow-extrapolation", "--max-new-tokens", "8")
    assert request.limits == [8]
    [note] = request.notes
    assert "run past the 64 positions" in note and "--allow-extrapolation" in note


def test_the_suggested_scaling_passes(hf64):
    d = hf64()
    with pytest.raises(ConfigError) as e:
        _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--max-new-tokens", "8")
    flags = [w.rstrip(";,.") for w in str(e.value).split() if w.startswith("--model.rope")]
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--max-new-tokens", "8", *flags)
    assert request.limits == [8] and not request.notes


def test_a_scaling_with_the_default_original_is_refused_naming_it(hf64):
    """yarn x 4 added over weights of 64 positions, its original left at the default 8,192: the 101-token
    prompt ran as within the reach (64 x 4); now refused, saying why and with flags that do cover it."""
    d = hf64()
    scaled = ("--model.rope_scaling=yarn", "--model.rope_factor=4")
    with pytest.raises(ConfigError, match="model.rope_original_max_len 8,192 is past the 64 positions") as e:
        _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--max-new-tokens", "8", *scaled)
    assert "--model.rope_original_max_len=64" in str(e.value)


def test_a_yarn_scaled_model_reads_longer_prompts(hf64):
    d = hf64(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--max-new-tokens", "8")
    assert request.limits == [8] and len(request.prompts[0]["ids"]) > 64


def test_new_tokens_capped_at_the_reach(hf64):
    d = hf64()
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", "def f(x):", "--max-new-tokens", "300")
    n = len(request.prompts[0]["ids"])
    assert request.limits == [64 - n] and "within the 64 positions the model reaches" in request.notes[0]


def test_a_checkpoint_is_held_to_its_recorded_positions(tmp_path):
    """A longctx checkpoint (weightless: the guard reads only the manifest) trained on 64 positions,
    its max_seq_len the default 131072: the recorded 64 decides."""
    cfg = load_config(None, {"model": {"layers": 1}})
    model = to_dict(cfg)["model"]
    step = tmp_path / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    write_manifest(step, step=2, layout={}, model=model, tokenizer="byte", trained_positions=64)
    with pytest.raises(ConfigError, match="trained on 64: the trained_positions its manifest records"):
        _prepare("--checkpoint", str(step), "--prompt", "x" * 100, "--model.max_seq_len=4096")
    request = _prepare("--checkpoint", str(step), "--prompt", "x" * 60, "--max-new-tokens", "10")
    assert request.limits == [4]
    # written before the record: its max_seq_len, as before
    write_manifest(step, step=2, layout={}, model=model, tokenizer="byte")
    assert "trained_positions" not in read_manifest(step)
    assert _prepare("--checkpoint", str(step), "--prompt", "x" * 100).limits == [256]


def test_hf_linear_scaling_stretches_max_position_embeddings(hf64):
    """A linear-scaled config gives the length before its factor (vicuna-16k: 4096 x 4), as vLLM reads it."""
    d = hf64(rope_scaling=dict(rope_type="linear", factor=4.0))
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", PROMPT, "--max-new-tokens", "8")
    assert request.limits == [8]
    with pytest.raises(ConfigError, match="past the 256 positions .* x its linear RoPE factor"):
        _prepare("--checkpoint", f"hf:{d}", "--prompt", "x " * 300)


def test_the_suggestion_for_an_already_scaled_model_passes(hf64):
    """A yarn model (max_position_embeddings 64, original 32 x factor 4: it reaches 128): the suggested
    factor stretches the unscaled 32, so following the message is not refused again."""
    d = hf64(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))
    long = "x " * 150
    with pytest.raises(ConfigError, match="past the 128 positions") as e:
        _prepare("--checkpoint", f"hf:{d}", "--prompt", long, "--max-new-tokens", "8")
    flags = [w.rstrip(";,.") for w in str(e.value).split() if w.startswith("--model.rope")]
    assert "--model.rope_original_max_len=32" in flags
    request = _prepare("--checkpoint", f"hf:{d}", "--prompt", long, "--max-new-tokens", "8", *flags)
    assert request.limits == [8] and not request.notes


def test_eval_says_once_which_lengths_run_past_the_reach(hf64):
    """longctx eval (issue 53): lengths past the reach run (an extension study measures them) with one
    note naming the trained length and a scaling that covers them; that scaling then covers them."""
    from longctx.eval.request import reach_notes

    d = hf64()
    m = load_config(None, {"model": {"init_from": f"hf:{d}", "max_seq_len": 256}, "train": {"seq_len": 64}}).model
    assert reach_notes(m, [32, 64]) == ()
    [note] = reach_notes(m, [32, 128, 256])
    assert note.startswith("lengths 128, 256 run past the 64 positions the model reaches (trained on 64:")
    flags = note.split("; ")[-1].removesuffix(" would cover them").split()
    assert flags == ["--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_max_len=64"]
    scaled = load_config(None, {"model": {"init_from": f"hf:{d}", "max_seq_len": 256, "rope_scaling": "yarn",
                                          "rope_factor": 4.0, "rope_original_max_len": 64},
                                "train": {"seq_len": 64}}).model
    assert reach_notes(scaled, [32, 128, 256]) == ()


def test_a_windowed_models_reach_is_read_and_capped_at_its_window(tmp_path):
    """trained_positions read a windowed config.json (Mistral-7B-v0.1: window 4,096 of 32,768) under the
    training-length refusal, so model_reach, and with it every `longctx generate` / eval of such a model,
    was refused, also with the --model.max_seq_len the refusal suggested. The reach is the window now."""
    from longctx.config.positions import model_reach
    from longctx.generate.engine import generate
    from longctx.models.hf import load_hf_weights
    from longctx.models.llama import build_model

    d, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("mistral", sliding_window=32))
    cfg = load_config(overrides=[f"--model.init_from=hf:{d}", "--model.max_seq_len=32", "--train.seq_len=32"])
    reach = model_reach(cfg.model)
    assert (reach.positions, reach.window, reach.trained) == (32, 32, 256)
    model = build_model(cfg.model)
    load_hf_weights(model, d)
    assert len(generate(model, [list(range(1, 21))], max_new_tokens=12)[0].tokens) == 12


@pytest.mark.parametrize("scaling", ["yarn", "llama3"])
@pytest.mark.parametrize("original", [64, 32, 8192])
def test_a_scaling_added_reaches_only_angles_the_weights_turned_through(scaling, original):
    """What the reach promises, from the frequencies themselves: up to it every rotary pair either turned
    through a whole period within the 64 trained positions, or stays within the angle it reached there.
    An original length past the trained one (the default 8,192) leaves the pairs whose wavelengths lie
    between unscaled: at position 255 they turned up to 4x past any trained angle, and the reach said 256."""
    import math

    from longctx.models.llama import rope_inv_freq

    trained, none = 64, _model()
    now = _model(rope_scaling=scaling, rope_factor=4.0, rope_original_max_len=original)
    reach = covered_positions(now, none, trained)
    base, scaled = rope_inv_freq(none).double(), rope_inv_freq(now).double()
    turned = 2 * math.pi / base <= trained  # (a whole period seen: every angle of the pair was trained)
    within = (reach - 1) * scaled <= trained * base * (1 + 1e-9)
    assert bool((turned | within).all()), (reach, ((reach - 1) * scaled / (trained * base))[~turned].max())
    assert reach == (max(trained, original * 4) if original <= trained else trained)  # (no less than the rule)
