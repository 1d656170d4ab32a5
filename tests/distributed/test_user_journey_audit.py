"""A demanding user's journey across the seams between features, each step checked against transformers:
a tiny Llama (untied) and Qwen3 (q/k norm, tied embeddings) written by transformers with a tokenizer and
trained on 64 positions; trained by longctx from `hf:DIR` with a 4x context extension (YaRN, linear) at
256 tokens; resumed from its step-3 checkpoint under head 2 x ctx 2 (gloo); exported to a Hugging Face
directory; read back by transformers (config, logits past the original 64 positions, greedy generation)
and by longctx (`hf:` import, `longctx generate` on the export and on the checkpoint, the reach it trusts).

Found by this audit: the export wrote config.json's max_position_embeddings from model.max_seq_len, so a
linear-scaled run read back as reaching factor x further than it trained (a linear config.json gives the
length before its factor: vLLM and longctx's own reader multiply), a from-scratch run trained on 128
positions as reaching the preset's 131,072; and the source's tokenizer_config.json kept its
model_max_length 64, so transformers' tokenizer cut the extended model's inputs to 64 tokens when asked to
truncate. One 4-rank job holds the three resumes."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.job.spawn import run_spawned_many  # noqa: E402
from longctx.train.trainer import train  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "e2e"))
sys.path.insert(0, str(TESTS / "unit"))
from test_newcomer import longctx_here  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ORIGINAL, LENGTH = 64, 256  # the source's trained positions; the extension's (4x)
BASE = ["--train.steps=6", "--train.global_batch=2", f"--train.seq_len={LENGTH}", f"--model.max_seq_len={LENGTH}",
        "--train.lr=1e-3", "--train.warmup_steps=1", "--train.eval_interval=0", "--data.max_docs=60",
        "--metrics.plots=false", "--metrics.progress=false", "--checkpoint.interval=3", "--checkpoint.keep=2"]
SCALINGS = {"yarn": ["--model.rope_scaling=yarn", "--model.rope_factor=4", f"--model.rope_original_max_len={ORIGINAL}"],
            "linear": ["--model.rope_scaling=linear", "--model.rope_factor=4"]}
JOURNEYS = {"llama-yarn": ("llama", "yarn"), "qwen3-yarn": ("qwen3", "yarn"), "llama-linear": ("llama", "linear")}
LAYOUT = ["--parallel.head=2", "--parallel.ctx=2"]


def _source(d: Path, family: str, tokenizer: Path) -> Path:
    """A random model written by transformers' save_pretrained (trained, as its config says, on 64
    positions), with a BPE tokenizer and a tokenizer_config.json that says that length too."""
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6, hidden_act="silu",
                  max_position_embeddings=ORIGINAL, initializer_range=0.25, rope_theta=10000.0, bos_token_id=1,
                  eos_token_id=0)  # (a wide init: varied greedy tokens, logits of order 10)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=True,
                                                                       attention_bias=False))
    return save_hf_dir(model, d, tokenizer, ORIGINAL)


def save_hf_dir(model, d, tokenizer, max_length: int):
    """`model` (transformers) saved into `d` with `tokenizer` (a tokenizer.json) and its tokenizer_config.json,
    its norms drawn away from 1 first (norms at 1 would hide a q/k-norm or layer-norm weight read wrongly)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d)
    shutil.copyfile(tokenizer, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": max_length, "eos_token": "</s>",
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def _train(args, run_dir):
    cfg = load_config(None, [*BASE, *args, f"--train.run_dir={run_dir}"])
    return list(train(cfg, log=lambda *a, **k: None).losses)


@pytest.fixture(scope="module")
def journeys(tmp_path_factory):
    """{name: (source dir, run dir, export dir, uninterrupted losses, resumed losses)}: each trained 6 steps
    in one process (saving steps 3 and 6), resumed from step 3 under head 2 x ctx 2 into run/b, which is
    exported."""
    base = tmp_path_factory.mktemp("journey")
    tokenizer = bpe_tokenizer(base / "tokenizer.json")
    torch.manual_seed(0)
    sources = {f: _source(base / f"{f}_hf", f, tokenizer) for f in ("llama", "qwen3")}
    args = {name: [f"--model.init_from=hf:{sources[f]}", *SCALINGS[s]] for name, (f, s) in JOURNEYS.items()}
    runs = {name: base / name for name in JOURNEYS}
    whole = {name: _train(args[name], runs[name]) for name in JOURNEYS}
    jobs = [(name, _train, ([*args[name], *LAYOUT, f"--checkpoint.resume={runs[name]}/checkpoints/step-00000003",
                             f"--checkpoint.dir={runs[name]}/b"], str(runs[name]))) for name in JOURNEYS]
    resumed = {name: per_rank[0] for name, per_rank in run_spawned_many(4, jobs).items()}
    out = {}
    for name, (family, _) in JOURNEYS.items():
        export, _, _, _ = export_hf(runs[name] / "b", base / f"{name}_export")
        out[name] = sources[family], runs[name], export, whole[name], resumed[name]
    return out


def _checkpoint_model(run):
    from longctx.checkpoint.manifest import read_manifest
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.config.checkpoint_paths import find_checkpoint
    from longctx.config.hf import model_config
    from longctx.models.llama import build_model

    path = find_checkpoint(run / "b")
    model = build_model(model_config(read_manifest(path)["model"]), device="cpu", seed=None)
    load_model_weights(path, model)
    return model.eval()


def _transformers(export, **rope):
    config = transformers.AutoConfig.from_pretrained(export)
    if rope:
        config.rope_parameters = rope
    return transformers.AutoModelForCausalLM.from_pretrained(export, config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", JOURNEYS)
def test_resumed_under_head2_ctx2_trains_as_one_process(journeys, name):
    *_, whole, resumed = journeys[name]
    assert len(resumed) == 3 and max(abs(a - b) for a, b in zip(resumed, whole[3:])) <= 1e-4, (resumed, whole)


@pytest.mark.parametrize("name", JOURNEYS)
def test_config_json_says_what_was_trained(journeys, name):
    family, scaling = JOURNEYS[name]
    _, _, export, _, _ = journeys[name]
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and config["rope_theta"] == 10000.0
    assert config["tie_word_embeddings"] == (family == "qwen3")
    rope = config["rope_scaling"]
    assert (rope["rope_type"], rope["factor"]) == (scaling, 4.0)
    # the length every reader serves: vLLM (and longctx) take yarn's original x factor and a linear config's
    # max_position_embeddings x factor; the run trained on 256 positions
    reach = rope["original_max_position_embeddings"] * 4 if scaling == "yarn" else config["max_position_embeddings"] * 4
    assert reach == LENGTH and config["max_position_embeddings"] <= LENGTH
    theirs = _transformers(export)
    assert theirs.config.rope_parameters["rope_type"] == scaling and theirs.config.rope_parameters["factor"] == 4.0
    assert hasattr(theirs.model.layers[0].self_attn, "q_norm") == (family == "qwen3")
    assert (theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()) == (family == "qwen3")


@pytest.mark.parametrize("name", JOURNEYS)
def test_logits_past_the_original_length_match_transformers(journeys, name):
    """transformers on the export = the checkpoint = longctx's `hf:` import of the export, at 256 positions;
    the same weights under an unscaled RoPE differ past 64: a wrong rope_scaling would show."""
    from longctx.models.hf import load_hf

    _, run, export, _, _ = journeys[name]
    tokens = torch.randint(0, 300, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = _transformers(export)(tokens).logits
        ours = _checkpoint_model(run)(tokens)
        imported = load_hf(export).eval()(tokens)
        unscaled = _transformers(export, rope_type="default", rope_theta=10000.0)(tokens).logits
    assert (ours - reference)[:, ORIGINAL:].abs().max().item() <= 1e-4
    assert (ours - reference).abs().max().item() <= 1e-4
    assert (imported - reference).abs().max().item() <= 1e-4
    assert (unscaled - reference)[:, ORIGINAL:].abs().max().item() > 1e-1


def _prompt(tokenizer, at_least: int) -> str:
    line, text = "import os\nprint(os.getcwd())\nclass A:\n    def f(x):\n        return x + 1\n", ""
    while len(tokenizer(text).input_ids) < at_least:
        text += line
    return text


@pytest.mark.parametrize("name", JOURNEYS)
def test_greedy_generation_matches_transformers_on_export_and_checkpoint(journeys, name):
    _, run, export, _, _ = journeys[name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    prompt = _prompt(tokenizer, 70)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    new = 80  # the continuation runs from position ~70 to ~150, past the original 64
    with torch.no_grad():
        reference = _transformers(export).generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                                   eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert len(set(reference)) > 10  # not a degenerate repetition
    for checkpoint in (f"hf:{export}", str(run / "b")):
        r = longctx_here("generate", "--checkpoint", checkpoint, "--prompt", prompt, "--max-new-tokens", new,
                         "--ignore-eos")
        assert r.returncode == 0, r.stderr
        line = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
        assert line["prompt_tokens"] == ids.shape[1] and line["tokens"] == reference, checkpoint


@pytest.mark.parametrize("name", JOURNEYS)
def test_tokenizer_travels_and_reads_the_extended_length(journeys, name):
    """The source's tokenizer files are in the export; transformers' tokenizer there keeps a 200-token
    input whole under truncation=True (it cut it to the source's model_max_length, 64)."""
    source, _, export, _, _ = journeys[name]
    assert (export / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    text = _prompt(tokenizer, 200)
    assert tokenizer(text, truncation=True).input_ids == tokenizer(text).input_ids
    settings = json.loads((export / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "</s>" and settings["model_max_length"] == LENGTH


def _prepare(*argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", *map(str, argv)])
    return prepare(args, rest)


@pytest.mark.parametrize("name", JOURNEYS)
def test_the_export_reaches_what_the_checkpoint_reaches(journeys, name):
    """`longctx generate` trusts the export as far as the checkpoint it came from (256 positions): a
    prompt past it is refused on both, one within runs on both (the linear export read as 1,024)."""
    from longctx.errors import ConfigError

    _, run, export, _, _ = journeys[name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    long, short = _prompt(tokenizer, LENGTH + 20), _prompt(tokenizer, LENGTH - 40)
    for checkpoint in (f"hf:{export}", run / "b"):
        with pytest.raises(ConfigError, match=f"past the {LENGTH} positions"):
            _prepare("--checkpoint", checkpoint, "--prompt", long, "--max-new-tokens", 4)
        assert _prepare("--checkpoint", checkpoint, "--prompt", short, "--max-new-tokens", 4).limits == [4]


def test_a_from_scratch_export_says_the_length_it_trained_on(tmp_path):
    """The debug preset (max_seq_len 131,072) trained on 128 positions: the export said 131,072, which
    transformers' users and vLLM serve and `longctx generate` trusted; it says 128 now, as the checkpoint's
    record does, and the weights are still transformers' exactly."""
    from longctx.errors import ConfigError

    run = tmp_path / "run"
    cfg = load_config(None, ["--model.layers=1", "--model.dim=64", "--train.seq_len=128", "--train.steps=2",
                             "--train.eval_interval=0", "--data.max_docs=30", "--data.tokenizer=byte",
                             "--metrics.plots=false", "--metrics.progress=false", f"--train.run_dir={run}"])
    train(cfg, log=lambda *a, **k: None)
    export, _, _, notes = export_hf(run / "checkpoints", tmp_path / "export")
    assert json.loads((export / "config.json").read_text())["max_position_embeddings"] == 128
    assert any("131072" in n for n in notes)
    tokens = torch.randint(0, 320, (1, 128), generator=torch.Generator().manual_seed(2))
    from longctx.models.hf import load_hf

    with torch.no_grad():
        assert (_transformers(export)(tokens).logits - load_hf(export)(tokens)).abs().max().item() <= 1e-4
    for checkpoint in (f"hf:{export}", run / "checkpoints"):
        with pytest.raises(ConfigError, match="past the 128 positions"):
            _prepare("--checkpoint", checkpoint, "--tokenizer", "byte", "--prompt", "x" * 200)
