"""Review of the session 116 changes.

An append holds out the revision of a document its store's eval split holds by the fallback (nothing hashed into
it: the lowest-hash piece's sample-sized part). It held out the revision's own lowest-hash piece: a revision cut
into other pieces (a short document grown past the grid, a long one grown by pieces of lower hash) trained on the
very text its first version holds out, and was labelled "both" as if held out the same way."""

import json

import numpy as np
import pytest

from longctx.data import store
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store

LINES = [f"line {i} of the story of apples and pears, told once more\n" for i in range(40)]


def _build(inputs, out, **kw):
    opts = BuildOptions(inputs=[str(inputs)], out=str(out), progress=False, workers=1, seq_len=64, strategy="bfd",
                        dedup="exact", eval_fraction=0.001, **kw)
    build_store(opts, log=lambda *_: None)


def _docs(root):
    out = {}
    for part in store.read_manifest(root)["parts"]:
        lines = (root / part["dir"] / "docs.jsonl").read_text().splitlines()
        out.update({part["first_doc"] + i: json.loads(line) for i, line in enumerate(lines)})
    return out


def _spans(root, split, doc):
    """[start, end) of document `doc`'s tokens in `split`."""
    out = []
    for part in store.read_manifest(root)["parts"]:
        if part["splits"][split]["samples"]:
            segs = np.load(root / part["dir"] / f"{split}.segments.npy")
            out += [(s, s + n) for n, d, s in segs[:, [store.S_LENGTH, store.S_DOC, store.S_START]].tolist()
                    if d == doc]
    return sorted(out)


@pytest.mark.parametrize("first, revised", [(LINES[0], "".join(LINES)),  # short, grown past the grid
                                            ("".join(LINES[:10]), "".join(LINES))],  # long, grown by pieces
                         ids=["short-grown", "long-grown"])
def test_an_appended_revision_does_not_train_on_the_text_its_first_version_holds_out(tmp_path, first, revised):
    texts = {"one.txt": "the first document\n", "two.txt": first, "three.txt": "third: cherries\n"}
    (tmp_path / "a").mkdir()
    for name, text in texts.items():
        (tmp_path / "a" / name).write_text(text)
    _build(tmp_path / "a", tmp_path / "s")
    docs = _docs(tmp_path / "s")
    assert {r["name"] for r in docs.values() if r["split"] != "train"} == {"two.txt"}  # (the fallback's case)
    original = next(d for d, r in docs.items() if r["name"] == "two.txt")
    # (its held-out text, less a whole document's closing EOS: the revision goes on past it)
    held = [(a, min(b, docs[original]["tokens"] - 1)) for a, b in _spans(tmp_path / "s", "eval", original)]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text(revised)  # (its first version's text, with more after it)
    _build(tmp_path / "b", tmp_path / "s", append=True)
    docs = _docs(tmp_path / "s")
    revision = max(d for d, r in docs.items() if r["name"] == "two.txt")
    assert revision != original and _spans(tmp_path / "s", "eval", revision)
    trained = [(a, b) for a, b in _spans(tmp_path / "s", "train", revision) for c, e in held if a < e and c < b]
    assert not trained, f"the revision trains on {trained}, the text its first version holds out ({held})"


def test_a_checkpoint_whose_name_is_not_utf8_is_read_by_generate_and_refused_by_train(tmp_path):
    """The refusal of a string that is not UTF-8 (a Latin-1 name: Python holds the byte as a lone surrogate) sat in
    every config load, so `longctx generate --checkpoint $'caf\\xe9'` (and eval, bench decode), which write no
    config.toml and read such a directory as well as any, was refused with words about resuming a run. It is
    `longctx train`'s refusal (its config.toml), and to_toml's."""
    from longctx.cli import build_parser
    from longctx.config import load_config, to_toml
    from longctx.config.layout import resolve_layout
    from longctx.errors import ConfigError

    weights = tmp_path / "caf\udce9"  # (b"caf\xe9" on disk)
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320,
        "max_position_embeddings": 4096}))
    # (generate/cli.py's probe of its --checkpoint, and eval's)
    cfg = load_config(None, {"model": {"init_from": f"hf:{weights}"}, "train": {"seq_len": 2, "eval_interval": 0}})
    assert cfg.model.layers == 2 and cfg.model.init_from == f"hf:{weights}"
    with pytest.raises(ConfigError, match=r"model.init_from = .*is not UTF-8 text \(byte 0xe9"):
        to_toml(cfg)
    parsed, rest = build_parser("train").parse_known_args(["train", "--model.init_from", f"hf:{weights}"])
    with pytest.raises(ConfigError, match=r"model.init_from = .*is not UTF-8 text \(byte 0xe9"):
        resolve_layout(parsed.config, rest, 1)


def test_kv_heads_past_the_listed_range_are_not_said_to_have_no_head_degree():
    """check_heads lists the head degrees that fit by config/divisors.py, which lists none past 10**12 (`or []`):
    a mistyped count was told "choose parallel.head among []", as if no degree could work."""
    from longctx.errors import ConfigError
    from longctx.job.checks import check_heads

    with pytest.raises(ConfigError) as e:
        check_heads(6 * 10**12, 2, 3)
    assert "among []" not in str(e.value) and "divisors of 6000000000000" in str(e.value)
    with pytest.raises(ConfigError, match=r"choose parallel.head among \[1, 2, 4, 6, 8, 10, 12"):
        check_heads(6000, 2, 3)  # (a count that is listed still is)
