"""data.synthetic: a retrieval sequence's filler is the sample's text, never its padding.

A packed sample shorter than seq_len is padded with the pad token (the store's EOS) to its end; the
mixture took the sample's first tokens as filler whole, so a short sample's retrieval sequence held a
run of pad tokens before the question (training text no eval prompt has: eval fills from documents).
"""

import numpy as np

from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.data.loader import PackedSamples
from longctx.data.synthetic import SyntheticMixture
from longctx.data.tokenizer import ByteTokenizer


def _store(tmp_path, seq_len=256):
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):  # (130-140 bytes each: one document per sample, ~110 tokens of padding)
        words = " ".join(f"w{int(w)}" for w in rng.integers(10, 99, size=60))
        (src / f"d{i:02d}.txt").write_text(words[:int(rng.integers(130, 141))])
    out = tmp_path / "store"
    build_store(BuildOptions(inputs=[str(src)], out=str(out), seq_len=seq_len, strategy="bfd", dedup="none",
                             workers=1, stats=False, progress=False), log=lambda *_: None)
    return PackedSamples(out)


def _longest_run(tokens: np.ndarray, value: int) -> int:
    best = run = 0
    for t in tokens.tolist():
        run = run + 1 if t == value else 0
        best = max(best, run)
    return best


def test_the_filler_of_a_short_sample_holds_no_padding(tmp_path):
    store = _store(tmp_path)
    pad = int(store.manifest["tokenizer"]["pad_id"])
    assert (store.real_tokens < store.seq_len - 100).all()  # (every sample is padded)
    mixture = SyntheticMixture(store, "passkey", 1.0, seed=3, tokenizer=ByteTokenizer())
    for i in range(len(store)):
        tokens, labels, _, _ = mixture.sample(i)
        assert len(tokens) == store.seq_len and (labels != -100).sum() == len(" 12345.")
        # a document's text has one EOS at its end, never two in a row: a run is padding
        assert _longest_run(tokens, pad) <= 1, (i, _longest_run(tokens, pad))
        text = ByteTokenizer().decode(tokens.tolist())
        assert text.count("Remember it.") == 1  # (one needle: the text repeated, never the needle)
