import numpy as np
import pytest

from longctx.data.corpus import corpus_files, read_documents, stdlib_root
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from longctx.data.windows import IGNORE, TokenWindows, WindowSampler, split_documents
from longctx.errors import DataError


def test_stdlib_corpus_is_found_without_site_packages():
    root, files = corpus_files("stdlib")
    assert root == stdlib_root()
    assert len(files) > 500
    assert not any("site-packages" in f.parts for f in files)
    assert any(f.name == "os.py" for f in files)
    docs = read_documents("stdlib", max_docs=50)
    assert len(docs) == 50 and all(d.text for d in docs)


def test_directory_corpus_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.bin").write_bytes(b"\x00\x01")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("world")
    assert [d.name for d in read_documents(str(tmp_path))] == ["a.txt", "sub/c.md"]
    with pytest.raises(DataError, match="neither 'stdlib' nor an existing directory"):
        read_documents(str(tmp_path / "nope"))


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def foo(): return bar"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    ours = load_tokenizer(str(path))
    assert isinstance(ours, HFTokenizer)
    assert ours.eos_id == tok.token_to_id("<|endoftext|>")
    ids = ours.encode_batch(["def foo", "return bar"])
    assert [list(i) for i in ids] == [tok.encode(t).ids for t in ("def foo", "return bar")]
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


def toy_windows(doc_mask):
    # documents of lengths 3, 1, 6 (+EOS each): stream = 1 1 1 E 2 E 3 3 3 3 3 3 E
    arrays = [np.array([1, 1, 1]), np.array([2]), np.array([3] * 6)]
    return TokenWindows(arrays, eos_id=9, seq_len=6, doc_mask=doc_mask)


def test_windows_carry_labels_positions_and_doc_ids():
    w = toy_windows(doc_mask=True)
    assert len(w) == 2  # 13 tokens -> (13 - 1) // 6 windows
    b = w.batch([0, 1])
    assert b.tokens.tolist() == [[1, 1, 1, 9, 2, 9], [3, 3, 3, 3, 3, 3]]
    # a label in the next document is ignored: the model cannot see that document
    assert b.labels.tolist() == [[1, 1, 9, IGNORE, 9, IGNORE], [3, 3, 3, 3, 3, 9]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert b.doc_ids.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0]]
    assert b.valid_tokens == 10


def test_windows_without_doc_mask_are_plain_concatenation():
    b = toy_windows(doc_mask=False).batch([0])
    assert b.labels.tolist() == [[1, 1, 9, 2, 9, 3]]
    assert b.positions.tolist() == [[0, 1, 2, 3, 4, 5]] and b.doc_ids is None


def test_too_short_corpus_is_an_error():
    with pytest.raises(DataError, match="fewer than one window"):
        TokenWindows([np.array([1, 2])], eos_id=0, seq_len=8, doc_mask=True)


def test_sampler_is_seeded_covers_each_epoch_and_resumes_from_cursor():
    a = WindowSampler(10, seed=3)
    first = a.next_indices(10)
    assert sorted(first) == list(range(10))
    assert first != WindowSampler(10, seed=4).next_indices(10)
    more = a.next_indices(7)
    b = WindowSampler(10, seed=3)
    b.load_state_dict({"cursor": 10})
    assert b.next_indices(7) == more


def test_eval_split_is_by_name_and_stable():
    from longctx.data.corpus import Document

    docs = [Document(f"f{i}.py", "x") for i in range(2000)]
    train, evals = split_documents(docs, 0.05)
    assert 50 < len(evals) < 150 and len(train) + len(evals) == 2000
    _, evals_sub = split_documents(docs[:1000], 0.05)
    assert {d.name for d in evals_sub} == {d.name for d in evals if int(d.name[1:-3]) < 1000}
