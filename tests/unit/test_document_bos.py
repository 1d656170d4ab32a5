"""Documents begin as a pretrained model saw them: a tokenizer whose post-processing puts special tokens
before a text (Llama's BOS) has them at the start of every document of a store, which records them;
a run records its store's in each checkpoint, so `longctx generate` and `longctx eval` prompt the
fine-tuned model as it trained (and the synthetic mixture's sequences begin with them too). A tokenizer
that adds none and the byte tokenizer are unchanged; a store or checkpoint from before they were
recorded keeps its documents' (none) and says so where it matters."""

import json

import pytest
from test_data_build import opts, quiet, store_documents
from test_eval_prompt_prefix import _bos_tokenizer

from longctx.cli import build_parser
from longctx.config import load_config
from longctx.config.tokenizer import model_text_prefix as special_prefix
from longctx.data import store
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.data.samples import IGNORE
from longctx.data.synthetic import SyntheticMixture
from longctx.data.tokenizer import HFTokenizer
from longctx.errors import DataError
from longctx.generate.cli import prepare
from longctx.models.hf import save_hf
from longctx.models.llama import build_model
from longctx.train.trainer import Trainer

TEXTS = ["def f(x):\n    return x + 1\n" * (3 + i) + "class A:\n    pass\n" * (i % 4) + "import os\n" * 2
         for i in range(24)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(the BOS tokenizer's file and its BOS id, the same tokenizer without its post-processor, inputs dir)."""
    tmp = tmp_path_factory.mktemp("bos")
    bos = _bos_tokenizer(tmp / "bos.json")
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(tmp / "bos.json"))
    plain.post_processor = None
    plain.save(str(tmp / "plain.json"))
    inputs = tmp / "in"
    inputs.mkdir()
    for i, t in enumerate(TEXTS):
        (inputs / f"doc{i:02d}.py").write_text(t)
    return tmp / "bos.json", bos, tmp / "plain.json", inputs


def _build(inputs, out, tokenizer, seq_len=64, **kw):
    kw = {"strategy": "bfd", "dedup": "none", "eval_fraction": 0.0, **kw}
    return build_store(opts([inputs], out, seq_len, tokenizer=str(tokenizer), **kw), log=quiet)


def test_every_document_begins_with_the_tokenizers_bos_and_the_store_records_it(tokenizers, tmp_path):
    bos_file, bos, plain_file, inputs = tokenizers
    with_bos = _build(inputs, tmp_path / "bos", bos_file)
    without = _build(inputs, tmp_path / "plain", plain_file)
    byte = _build(inputs, tmp_path / "byte", "byte")
    assert with_bos["tokenizer"]["text_prefix"] == [bos]
    assert without["tokenizer"]["text_prefix"] == [] and byte["tokenizer"]["text_prefix"] == []
    docs, plain_docs = store_documents(tmp_path / "bos"), store_documents(tmp_path / "plain")
    assert len(docs) == len(TEXTS) and docs.keys() == plain_docs.keys()
    for d, tokens in docs.items():  # the prefix, then exactly what the tokenizer without it gives
        assert list(tokens) == [bos, *plain_docs[d]], d
    assert all(tokens[0] != 256 for tokens in store_documents(tmp_path / "byte").values())
    # the cut points of a long document count the prefix: the pieces still tile it
    small = _build(inputs, tmp_path / "cut", bos_file, strategy="concat")
    assert small["tokenizer"]["text_prefix"] == [bos]
    assert {d: list(t) for d, t in store_documents(tmp_path / "cut").items()} == {d: list(t) for d, t in docs.items()}


def test_an_append_to_a_store_from_before_the_prefix_is_refused(tokenizers, tmp_path):
    bos_file, _, _, inputs = tokenizers
    _build(inputs, tmp_path / "s", bos_file)
    manifest = store.read_manifest(tmp_path / "s")
    del manifest["tokenizer"]["text_prefix"]  # as a store written before documents began with it
    store.write_manifest(tmp_path / "s", manifest)
    from longctx.train.setup import _missing_prefix

    assert "rebuild it" in _missing_prefix(manifest)
    with pytest.raises(DataError, match="an append would mix the two. Rebuild the store"):
        _build(inputs, tmp_path / "s", bos_file, append=True)


def test_the_synthetic_mixture_begins_each_sequence_with_the_prefix(tokenizers, tmp_path):
    bos_file, bos, _, inputs = tokenizers
    _build(inputs, tmp_path / "s", bos_file, 256, strategy="concat")  # (most samples start inside a document)
    samples = PackedSamples(tmp_path / "s", "train")
    tok = HFTokenizer(bos_file)
    mixture = SyntheticMixture(samples, "passkey", 1.0, 7, tok)
    starts = [int(samples.sample(i)[0][0]) for i in range(len(samples))]
    assert any(s != bos for s in starts)  # (so the filler alone does not put it there)
    for i in range(len(samples)):
        tokens, labels, positions, _ = mixture.sample(i)
        assert len(tokens) == samples.seq_len and tokens[0] == bos and labels[0] == IGNORE
        answer = tok.decode(tokens[1:][labels[:-1] != IGNORE])
        assert answer.strip().rstrip(".").isdigit() and answer.endswith("."), answer


def test_a_retrieval_sequence_begins_with_one_bos_not_two(tokenizers, tmp_path):
    """The mixture puts the store's BOS first, as eval prompts begin; its filler, the sample's text, began with
    the sample's first document's BOS too: a synthetic sample of a store packed whole read BOS BOS."""
    bos_file, bos, _, inputs = tokenizers
    _build(inputs, tmp_path / "s", bos_file, 256)  # (bfd: every sample starts with a document, its BOS)
    samples = PackedSamples(tmp_path / "s", "train")
    assert all(int(samples.sample(i)[0][0]) == bos for i in range(len(samples)))
    mixture = SyntheticMixture(samples, "passkey", 1.0, 7, HFTokenizer(bos_file))
    for i in range(len(samples)):
        tokens = mixture.sample(i)[0]
        assert tokens[0] == bos and tokens[1] != bos, (i, tokens[:4])


def test_a_run_records_it_and_generate_and_eval_prompt_its_checkpoint_with_it(tokenizers, tmp_path):
    bos_file, bos, _, inputs = tokenizers
    model = build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1)
    hf = save_hf(model, tmp_path / "hf")
    (hf / "tokenizer.json").write_bytes(bos_file.read_bytes())
    _build(inputs, tmp_path / "s", hf / "tokenizer.json")
    run = tmp_path / "run"
    cfg = load_config(None, [f"--model.init_from=hf:{hf}", f"--data.path={tmp_path / 's'}", "--train.seq_len=64",
                             "--train.steps=1", "--train.global_batch=2", "--train.eval_interval=0",
                             "--metrics.plots=false", "--metrics.progress=false", "--train.device=cpu",
                             "--checkpoint.final=true", f"--train.run_dir={run}"])
    trainer = Trainer(cfg, log=quiet)
    trainer.run()
    step = run / "checkpoints" / "step-00000001"
    assert json.loads((step / "manifest.json").read_text())["text_prefix"] == [bos]

    def prompt_ids(checkpoint):
        args, rest = build_parser("generate").parse_known_args(
            ["generate", "--checkpoint", str(checkpoint), "--prompt", "def f(x):"])
        return prepare(args, rest).prompts[0]["ids"]

    tok = HFTokenizer(bos_file)
    text = [int(t) for t in tok.encode("def f(x):")]
    assert prompt_ids(run / "checkpoints") == [bos, *text]
    assert prompt_ids(f"hf:{hf}") == [bos, *text]  # (the model it started from: the same)
    assert special_prefix(str(run / "checkpoints"), tok) == [bos]
    # a checkpoint from before the prefix was recorded trained without it: prompted without it
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["text_prefix"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert prompt_ids(run / "checkpoints") == text
    assert special_prefix(str(run / "checkpoints"), tok) == []
