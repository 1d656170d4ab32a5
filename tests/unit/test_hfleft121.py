"""Two leftovers of the Hugging Face import.

(1) A config.json value of the wrong type or range, the Mixture-of-Experts keys included: one HFFormatError naming
the key, its value (as JSON) and the fix, before any tensor is read, where before an expert count "8" stopped with a
bare TypeError and 8.5, true or null were read silently (as 8, 1 or the family default). Integer keys hold JSON
integers: transformers 5's strict config classes refuse 8.0 too. A seeded fuzz against transformers checks that every
refusal is an HFFormatError and that what transformers builds and runs still imports.
(2) pad_token_id: every family longctx imports builds its embedding with padding_idx = config.pad_token_id, so that
row gets no gradient there; model.padding_idx does the same here, filled by the import (OLMoE's class default 1
included), recorded in the manifest, written back by the export; -1 (none) by default.
"""

import json
import random
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from test_hf import hf_config  # noqa: E402

from longctx.checkpoint import export  # noqa: E402
from longctx.checkpoint.manifest import FORMAT  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.config.hf import HFFormatError, model_fields_from_hf  # noqa: E402
from longctx.config.load import to_dict  # noqa: E402
from longctx.data.samples import Batch  # noqa: E402
from longctx.errors import ConfigError  # noqa: E402
from longctx.models.hf import load_hf, save_hf  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.step.loss import forward_loss_sum  # noqa: E402

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[]),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                         mlp_only_layers=[]),
       "olmoe": dict(num_experts=4, num_experts_per_tok=2)}
FAMILIES = DENSE + tuple(MOE)
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


def config(family: str, **extra) -> dict:
    """A tiny config.json of `family` (vocab_size 300, 4 heads of 16 or, for mistral / qwen3, 32)."""
    d = hf_config(family if family in DENSE else "llama")
    d.update(model_type=family, architectures=[CLASSES[family]], **MOE.get(family, {}))
    d.update(extra)
    return d


def _dir(tmp_path, hf: dict, name: str = "hf"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    return d


def _run_config(d):
    return load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=64"])


# (family, changed keys, what the error says)
REFUSED = {
    "experts-integral-float": ("mixtral", dict(num_local_experts=4.0), r"num_local_experts is 4\.0, not an integer "
                               r".*MixtralConfig refuses it.*write 4, a JSON integer"),
    "experts-text": ("mixtral", dict(num_local_experts="4"), r"num_local_experts is \"4\", not an integer"),
    "experts-bool": ("olmoe", dict(num_experts=True), r"num_experts is true, not an integer"),
    "experts-fraction": ("qwen2_moe", dict(num_experts=4.5), r"num_experts is 4\.5, not an integer.*the number of "
                         r"experts the weights hold"),
    "experts-null": ("qwen3_moe", dict(num_experts=None), r"num_experts is null, not an integer"),
    "experts-negative": ("olmoe", dict(num_experts=-2), r"num_experts is -2, not an integer"),
    "experts-twice": ("mixtral", dict(num_experts=3), r"given twice, num_local_experts=4 and num_experts=3"),
    "top-k-null": ("mixtral", dict(num_experts_per_tok=None), r"num_experts_per_tok is null"),
    "top-k-float": ("olmoe", dict(num_experts_per_tok=2.0), r"num_experts_per_tok is 2\.0.*write 2"),
    "moe-width-text": ("qwen3_moe", dict(moe_intermediate_size="32"), r"moe_intermediate_size is \"32\", not a "
                       r"positive integer"),
    "moe-width-zero": ("qwen2_moe", dict(moe_intermediate_size=0), r"moe_intermediate_size is 0, not a positive"),
    "shared-width-float": ("qwen2_moe", dict(shared_expert_intermediate_size=48.0),
                           r"shared_expert_intermediate_size is 48\.0.*write 48"),
    "shared-width-negative": ("qwen2_moe", dict(shared_expert_intermediate_size=-1),
                              r"shared_expert_intermediate_size is -1, not an integer \(0 or more\)"),
    "sparse-step-bool": ("qwen3_moe", dict(decoder_sparse_step=True), r"decoder_sparse_step is true"),
    "dense-layers-text": ("qwen2_moe", dict(mlp_only_layers="0,1"), r"mlp_only_layers is \"0,1\", not a list"),
    "aux-coef-text": ("mixtral", dict(router_aux_loss_coef="0.01", output_router_logits=True),
                      r"router_aux_loss_coef is \"0.01\", not a number"),
    "aux-coef-null": ("olmoe", dict(router_aux_loss_coef=None), r"router_aux_loss_coef is null"),
    "aux-coef-negative": ("qwen3_moe", dict(router_aux_loss_coef=-0.5), r"router_aux_loss_coef is -0\.5"),
    "z-coef-bool": ("olmoe", dict(router_z_loss_coef=True), r"router_z_loss_coef is true.*longctx's export writes"),
    "positions-float": ("llama", dict(max_position_embeddings=256.0), r"max_position_embeddings is 256\.0, not a "
                        r"positive integer \(write 256"),
    "positions-fraction": ("qwen2", dict(max_position_embeddings=256.5), r"max_position_embeddings is 256\.5"),
    "positions-zero": ("mistral", dict(max_position_embeddings=0), r"max_position_embeddings is 0, not a positive"),
    "eps-zero": ("qwen3", dict(rms_norm_eps=0.0), r"rms_norm_eps is 0\.0, not a positive number"),
    "kv-heads-zero": ("llama", dict(num_key_value_heads=0), r"num_key_value_heads is 0, not a positive integer"),
    "kv-heads-not-dividing": ("qwen2", dict(num_key_value_heads=3), r"num_attention_heads=4 is not a multiple of "
                              r"num_key_value_heads=3"),
    "hidden-not-dividing": ("llama", dict(hidden_size=66), r"hidden_size=66 is not a multiple of "
                            r"num_attention_heads=4 and config.json gives no head_dim"),
    "odd-head": ("qwen3", dict(head_dim=15), r"the head size 15 is odd"),
    "pad-float": ("llama", dict(pad_token_id=3.0), r"pad_token_id is 3\.0, not an integer.*write 3"),
    "pad-text": ("olmoe", dict(pad_token_id="1"), r"pad_token_id is \"1\", not an integer"),
    "pad-bool": ("mixtral", dict(pad_token_id=True), r"pad_token_id is true"),
    "pad-past-vocab": ("qwen2", dict(pad_token_id=300), r"pad_token_id is 300, not a token id below vocab_size "
                       r"\(300\)"),
    "pad-before-vocab": ("qwen3_moe", dict(pad_token_id=-301), r"pad_token_id is -301"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_malformed_value_is_one_clear_error_naming_key_and_value(tmp_path, case):
    family, changes, said = REFUSED[case]
    d = _dir(tmp_path, config(family, **changes))
    for read in (_run_config, load_hf):  # (the run's config; load_hf: the directory holds no weights to read)
        with pytest.raises(HFFormatError, match=said):
            read(d)


# the values a fuzz draw puts into one key the family reads: wrong types, integral floats, nulls, ranges
VALUES = (4.0, "4", True, False, 4.5, None, 0, -1, 3, 1, [], {})
DENSE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "rms_norm_eps", "max_position_embeddings", "pad_token_id",
              "tie_word_embeddings", "attention_bias", "initializer_range")
MOE_KEYS = {"mixtral": ("num_local_experts", "num_experts", "num_experts_per_tok", "router_aux_loss_coef"),
            "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                          "shared_expert_intermediate_size", "mlp_only_layers", "router_aux_loss_coef"),
            "qwen3_moe": ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"),
            "olmoe": ("num_experts", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
                      "router_z_loss_coef")}
# what longctx refuses though transformers builds and runs it, on purpose (each said by an HFFormatError): no
# layers, experts or positions, a token choosing no expert, a sparse step that leaves the weights another model, the
# expert count given twice with two values, a head of one dimension (RoPE rotates pairs: transformers' rotate_half
# runs on one by rotating nothing), a bool where a count belongs (a class that is not strict takes true as 1)
DELIBERATE = {("num_experts", 0), ("num_local_experts", 0), ("num_experts_per_tok", 0), ("decoder_sparse_step", 3),
              ("num_local_experts", 3), ("num_local_experts", 1), ("num_experts", 3), ("num_experts", 1),
              ("head_dim", 1)}
NOT_POSITIVE = ("num_hidden_layers", "intermediate_size", "max_position_embeddings")


def _deliberate(key: str, value) -> bool:
    if isinstance(value, bool) or key in NOT_POSITIVE and type(value) is int and value <= 3:
        return True
    return type(value) is int and (key, value) in DELIBERATE


# keys a family's transformers class does not read, whose malformed values longctx refuses all the same (as before)
IGNORED = {(f, "attention_bias") for f in ("mistral", "qwen2", "mixtral", "qwen2_moe")}


def _transformers_runs(hf: dict) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
            model(torch.tensor([[1, 2, 3, 4]]))
        return True
    except Exception:  # noqa: BLE001 (any way transformers fails: its config's validation, its build, its forward)
        return False


@pytest.mark.parametrize("seed", range(4))
def test_fuzzed_values_are_refused_clearly_or_read_as_transformers_reads_them(tmp_path, seed):
    rng = random.Random(f"hfleft121-{seed}")
    for draw in range(30):
        family = rng.choice(FAMILIES)
        keys = [k for k in DENSE_KEYS + MOE_KEYS.get(family, ()) if (family, k) not in IGNORED]
        key, value = rng.choice(keys), rng.choice(VALUES)
        hf = config(family, **{key: value})
        try:
            ours = _run_config(_dir(tmp_path, hf, f"d{draw}"))
        except HFFormatError:
            ours = None
        except ConfigError as e:  # (the test's own train.seq_len past a short max_position_embeddings: its key)
            assert key == "max_position_embeddings" and "train.seq_len (64) exceeds" in str(e), (key, value, e)
            continue
        # (any other exception, a bare TypeError or a ConfigError of keys the user never set, fails the test)
        runs = _transformers_runs(hf)
        if runs and not _deliberate(key, value):
            assert ours is not None, (family, key, value)
        if ours is not None and key == "pad_token_id" and runs:
            assert ours.model.padding_idx == (-1 if value is None else value % 300), (family, value)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_default_pad_token_is_the_table_one(family):
    """with_family_defaults' pad_token_id (FAMILY_DEFAULTS: OLMoE's 1, none elsewhere) is the config class's."""
    from longctx.config.hf_families import with_family_defaults

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(transformers, CLASSES[family].replace("ForCausalLM", "Config"))().pad_token_id
    assert with_family_defaults({"model_type": family}).get("pad_token_id") == theirs


def _objective(model, ids):
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    model.train()
    loss = forward_loss_sum(model, Batch(ids, labels, torch.arange(ids.shape[1]).expand_as(ids), None), None)
    return loss / (labels != -100).sum()


@pytest.mark.parametrize("family, pad", [(f, 7) for f in FAMILIES] + [("olmoe", "default"), ("llama", -1),
                                                                      ("qwen2", None)])
def test_a_training_step_gives_the_embedding_transformers_gradient(tmp_path, family, pad):
    """transformers' embedding takes pad_token_id as padding_idx (its row no gradient); longctx's import the same,
    for an input that holds the pad id (before: longctx trained that row, its gradient 26.3 on this tiny llama where
    transformers gives 0, the largest of any other row being 0.63)."""
    hf = config(family, **({} if pad == "default" else {"pad_token_id": pad}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(5)
        ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf)).float()
        ref.save_pretrained(tmp_path / "hf")
    row = ref.model.embed_tokens.padding_idx  # (torch counts a negative one from the end: 299 for -1)
    assert row == {7: 7, "default": 1, -1: 299, None: None}[pad]
    ids = torch.tensor([[5, row or 9, 11, row or 9, 13, 17, 19, 23], [29, 31, row or 9, 37, 41, 43, 47, 53]])
    ref.train()
    want = torch.autograd.grad(ref(ids, labels=ids).loss, ref.model.embed_tokens.weight)[0]
    ours = load_hf(tmp_path / "hf")
    assert ours.cfg.padding_idx == (-1 if row is None else row)
    got = torch.autograd.grad(_objective(ours, ids), ours.tok_embeddings.weight)[0]
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    if row is not None:
        assert not got[row].any() and not want[row].any()


def test_from_scratch_padding_idx_starts_zero_and_stays_fixed():
    """model.padding_idx on a longctx model: the row starts at zero (as nn.Embedding and transformers initialise
    it) and a training step leaves it without gradient; the default -1 trains every row, as before."""
    cfg = load_config(overrides=["--model.padding_idx=5"]).model
    model = build_model(cfg, seed=0)
    ids = torch.tensor([[1, 5, 7, 5, 9, 11, 13, 5]])
    assert not model.tok_embeddings.weight[5].any()
    assert not torch.autograd.grad(_objective(model, ids), model.tok_embeddings.weight)[0][5].any()
    plain = build_model(load_config(overrides=[]).model, seed=0)
    assert plain.cfg.padding_idx == -1
    assert torch.autograd.grad(_objective(plain, ids), plain.tok_embeddings.weight)[0][5].any()


@pytest.mark.parametrize("value", [320, -2])
def test_a_padding_idx_outside_the_vocabulary_is_refused(value):
    with pytest.raises(ConfigError, match=f"model.padding_idx must be -1 .* below model.vocab_size \\(320\\), got "
                                          f"{value}"):
        load_config(overrides=[f"--model.padding_idx={value}"])


def _export(tmp_path, monkeypatch, hf, init_from=True, **over):
    """`longctx checkpoint export` of a checkpoint (its manifest: the weights do not enter config.json) of a run
    that started from `hf` (init_from) or from scratch with its shapes."""
    source = _dir(tmp_path, hf, "source")
    model = {**model_fields_from_hf(hf), "init_from": f"hf:{source}" if init_from else "", "preset": "hf", **over}
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 1, "model": model, "files": []}))
    monkeypatch.setattr(export, "load_model_weights", lambda *_: None)
    out, _, _, notes = export.export_hf(step, tmp_path / "out")
    return json.loads((out / "config.json").read_text())["pad_token_id"], " ".join(notes)


@pytest.mark.parametrize("family, pad, over, written, noted", [
    ("olmoe", "default", {}, 1, False),  # (OLMoE's default, imported as 1, written back)
    ("olmoe", "default", {"padding_idx": -1}, None, False),  # (none trained: null, which OLMoE reads as none)
    ("llama", 7, {}, 7, False),
    ("llama", -1, {}, -1, False),  # (the source's own spelling of row 299 is kept)
    ("llama", 7, {"padding_idx": -1}, 7, True),  # (the source's id kept for generation; the trained row is said)
    ("qwen3", None, {"padding_idx": 4}, 4, False),
])
def test_export_writes_the_padding_idx_back(tmp_path, monkeypatch, family, pad, over, written, noted):
    hf = config(family, **({} if pad == "default" else {"pad_token_id": pad}))
    got, notes = _export(tmp_path, monkeypatch, hf, **over)
    assert got == written
    assert ("this run trained that row (model.padding_idx -1)" in notes) == noted


def test_from_scratch_export_and_save_hf_write_it(tmp_path, monkeypatch):
    got, _ = _export(tmp_path, monkeypatch, config("llama"), init_from=False, padding_idx=6)
    assert got == 6
    model = build_model(load_config(overrides=["--model.padding_idx=9", "--model.family=qwen3",
                                               "--model.qk_norm=true"]).model, seed=0)
    save_hf(model, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["pad_token_id"] == 9
    assert load_hf(tmp_path / "saved").cfg.padding_idx == 9


def test_the_run_and_its_manifest_record_it_and_a_user_may_change_it(tmp_path):
    d = _dir(tmp_path, config("olmoe"))
    run = _run_config(d)
    assert run.model.padding_idx == 1 and to_dict(run)["model"]["padding_idx"] == 1
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    model = {**to_dict(run)["model"], "padding_idx": 1}
    (step / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": 1, "model": model, "files": []}))
    assert load_config(overrides=[f"--model.init_from={step}", "--train.seq_len=64"]).model.padding_idx == 1
    # (a training key: the weights compute the same whatever it says, so it may differ from config.json's)
    assert load_config(overrides=[f"--model.init_from=hf:{d}", "--train.seq_len=64",
                                  "--model.padding_idx=-1"]).model.padding_idx == -1
