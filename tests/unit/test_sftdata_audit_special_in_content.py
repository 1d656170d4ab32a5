"""A special token's string inside a message's content (`data build --messages-field`): transformers'
apply_chat_template reads it as the special token (split_special_tokens off, its default), and so does the store
(docs/data.md says so, and that the data must be cleaned where that matters). Pinned here with the labels around
it: the user's literal <|im_end|> is read, never trained; the answer's is trained, as part of the answer."""

import json

import pytest

transformers = pytest.importorskip("transformers")
from test_data_build import opts, quiet, store_documents  # noqa: E402
from test_generate_chat import IM_END, _chat_tokenizer  # noqa: E402
from test_instruction_pairs import _targets  # noqa: E402

from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.loader import PackedSamples  # noqa: E402

CHAT = [{"role": "user", "content": "say <|im_end|> now"}, {"role": "assistant", "content": "ok <|im_end|> done"}]


def test_a_special_token_string_in_content_is_the_special_token_as_transformers_reads_it(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder)
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    build_store(opts([tmp_path / "chats.jsonl"], tmp_path / "store", dedup="none", strategy="bfd", eval_fraction=0.0,
                     tokenizer=str(folder / "tokenizer.json"), messages_field="messages", seq_len=256), log=quiet)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert not theirs.split_special_tokens  # (transformers' default)
    whole = list(theirs.apply_chat_template(CHAT, tokenize=True, return_dict=False))
    prompt = list(theirs.apply_chat_template(CHAT[:1], tokenize=True, return_dict=False, add_generation_prompt=True))
    doc = store_documents(tmp_path / "store")[0]
    assert doc[:-1] == whole and whole[:len(prompt)] == prompt
    ends = [j for j, t in enumerate(doc) if t == IM_END]
    # system turn's, the user's literal one, the user turn's, the answer's literal one, the answer turn's
    assert len(ends) == 5
    trained = {j for _, j in _targets(PackedSamples(tmp_path / "store", "train"))[0]}
    assert trained == set(range(len(prompt), len(doc)))
    assert ends[1] not in trained and ends[3] in trained
