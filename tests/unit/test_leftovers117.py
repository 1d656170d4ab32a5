"""Small defects left by session 116: a linear-RoPE export with a non-integer factor round-trips its
max_position_embeddings exactly; DTS-Gate's expert count rounded half up, as its docs say; conversations' NFC / LF
normalisation, said in docs/data.md; an appended revision held out at its first version's held-out part also where
its own hash holds out another piece; generate's line text with a prompt given as raw ids."""

import json
from fractions import Fraction
from math import floor
from pathlib import Path

import numpy as np
import pytest

from longctx.config import load_config
from longctx.config.hf import model_config, model_fields_from_hf
from longctx.config.hf_export import hf_config_from_model

FACTORS = (1.5, 2.5, 3.3, 7 / 3)
POSITIONS = (4096, 1000, 777, 64)


def _linear_config(form: str, positions: int, factor: float) -> dict:
    """A debug llama's config.json, its RoPE linear by `factor` over `positions`, in either form."""
    config = hf_config_from_model(load_config(overrides=["--model.preset=debug"]).model)
    theta = config.pop("rope_theta")
    config.pop("rope_scaling", None)
    config["max_position_embeddings"] = positions
    if form == "rope_scaling":
        config["rope_theta"], config["rope_scaling"] = theta, {"rope_type": "linear", "factor": factor}
    else:
        config["rope_parameters"] = {"rope_type": "linear", "factor": factor, "rope_theta": theta}
    return json.loads(json.dumps(config))


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("factor", FACTORS)
def test_a_linear_export_round_trips_max_position_embeddings(form, factor):
    for positions in POSITIONS:
        first = model_fields_from_hf(_linear_config(form, positions, factor))
        exported = hf_config_from_model(model_config(first))
        assert exported["rope_scaling"]["factor"] == factor
        assert exported["max_position_embeddings"] == positions, (form, factor, positions, first["max_seq_len"])
        again = model_fields_from_hf(exported)
        assert again["max_seq_len"] == first["max_seq_len"], (form, factor, positions)
        # transformers' convention: the factor stretches the length before it (max_position_embeddings)
        assert positions * factor - 1 < first["max_seq_len"] <= positions * factor + 1e-9


def _dts(experts: int, top_k: int, steps: int):
    from longctx.models.moe import DTSRouter

    model = {"preset": "debug-moe", "dim": 16, "heads": 2, "kv_heads": 2, "moe.expert_dim": 12,
             "moe.experts": experts, "moe.top_k": top_k, "moe.router": "dts", "moe.dts_steps": steps,
             "moe.dts_temperature": 2.0}
    return DTSRouter(load_config(overrides={"model": model}).model)


def test_dts_gate_drops_experts_linearly_rounded_half_up():
    """docs/moe.md: E - (E - top_k) x step / dts_steps experts, floor(x + 1/2); ties (x.5) keep the larger count."""
    router = _dts(8, 2, 12)  # (every odd step is a tie: 8 - step / 2)
    assert [router.schedule(s)[1] for s in range(14)] == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2]
    for experts, top_k, steps in ((8, 2, 12), (8, 2, 4), (6, 1, 10), (16, 4, 8), (8, 1, 14), (4, 2, 4)):
        router = _dts(experts, top_k, steps)
        counts = [router.schedule(s)[1] for s in range(steps + 3)]
        assert counts[0] == experts and counts[steps:] == [top_k] * 3, (experts, top_k, steps, counts)
        assert all(a >= b for a, b in zip(counts, counts[1:])), counts
        documented = [floor(experts - (experts - top_k) * Fraction(min(s, steps), steps) + Fraction(1, 2))
                      for s in range(steps + 3)]
        assert counts == documented, (experts, top_k, steps)


RAW_CHAT = [{"role": "user", "content": "cafe\u0301 menu?\r\nline two\r\n"},
            {"role": "assistant", "content": "re\u0301sume\u0301:\r\nok"}]
NFC_LF_CHAT = [{"role": "user", "content": "caf\u00e9 menu?\nline two\n"},  # (written by hand, not by the code)
               {"role": "assistant", "content": "r\u00e9sum\u00e9:\nok"}]


def test_a_conversation_trains_the_ids_of_its_nfc_lf_rendering(tmp_path):
    """docs/data.md: a conversation's ids are apply_chat_template's of the NFC / LF text, not of the raw
    messages (a decomposed accent and CRLF in a message), and its conversations section says so."""
    transformers = pytest.importorskip("transformers")
    from test_data_build import opts, quiet, store_documents
    from test_generate_chat import _chat_tokenizer
    from test_instruction_pairs import _targets

    from longctx.data.builder.pipeline import build_store
    from longctx.data.loader import PackedSamples

    folder = tmp_path / "tok"
    folder.mkdir()
    _chat_tokenizer(folder)
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": RAW_CHAT}) + "\n")
    build_store(opts([tmp_path / "chats.jsonl"], tmp_path / "store", dedup="none", strategy="bfd", eval_fraction=0.0,
                     tokenizer=str(folder / "tokenizer.json"), messages_field="messages", seq_len=256), log=quiet)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))

    def ids(chat, **kw):
        return list(theirs.apply_chat_template(chat, tokenize=True, return_dict=False, **kw))

    doc = store_documents(tmp_path / "store")[0]
    assert doc[:-1] == ids(NFC_LF_CHAT) and doc[:-1] != ids(RAW_CHAT)
    prompt = ids(NFC_LF_CHAT[:1], add_generation_prompt=True)
    trained = {j for _, j in _targets(PackedSamples(tmp_path / "store", "train"))[0]}
    assert trained == set(range(len(prompt), len(doc)))
    docs = (Path(__file__).parents[2] / "docs" / "data.md").read_text()
    section = docs.split("### Conversations: `--messages-field`")[1].split("\n#")[0]
    assert "NFC" in section and "LF line ends" in section and "CRLF" in section


def test_an_append_never_trains_on_the_eval_text_of_a_revised_documents_first_version(tmp_path):
    """The first build holds out a part of two.txt by the fallback (no piece hashed into eval); its revision (the
    same text and more lines after) hashes its piece #13 into eval. The append held out #13 and skipped the
    fallback hold, so train held the first version's eval text, token for token."""
    from test_build_fuzz116 import build, doc_records, split_arrays

    from longctx.data import store

    def story(n):
        return "".join(f"line {i} of the story of apples and pears, told once more\n" for i in range(n))

    # eval_fraction 0.0019: of one.txt, three.txt, two.txt#0-#14, only two.txt#13 hashes below it (crc32 % 10**6
    # = 1,809); the first version is pieces #0-#9 (4 lines each at 256 tokens), its revision #0-#14
    kw = dict(seq_len=256, strategy="bfd", dedup="exact", eval_fraction=0.0019)
    (tmp_path / "a").mkdir()
    for name, text in {"one.txt": "the first document\n", "two.txt": story(40), "three.txt": "cherries\n"}.items():
        (tmp_path / "a" / name).write_text(text)
    build([tmp_path / "a"], tmp_path / "s", **kw)
    assert {r["name"]: r["split"] for r in doc_records(tmp_path / "s").values()} == {
        "one.txt": "train", "two.txt": "both", "three.txt": "train"}  # (the case: the fallback held part of it)
    (tokens, segments, _), = split_arrays(tmp_path / "s", "eval")
    (row, offset, first_start, first_size), = segments[:, [store.S_SAMPLE, store.S_OFFSET, store.S_START,
                                                           store.S_LENGTH]].tolist()
    held = np.array(tokens[row, offset:offset + first_size])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text(story(60))
    build([tmp_path / "b"], tmp_path / "s", append=True, **kw)
    records = doc_records(tmp_path / "s")
    revision = next(d for d, r in records.items() if d >= 3 and r["name"] == "two.txt")
    assert records[revision]["split"] == "both"
    trained = [(s, s + n) for _, segs, _ in split_arrays(tmp_path / "s", "train")
               for d, s, n in segs[:, [store.S_DOC, store.S_START, store.S_LENGTH]].tolist() if d == revision]
    overlap = [(s, e) for s, e in trained if s < first_start + first_size and e > first_start]
    assert not overlap, f"the revision trains on {overlap}, its first version's eval text [{first_start}, " \
                        f"{first_start + first_size})"
    for tokens_, _, _ in split_arrays(tmp_path / "s", "train"):
        windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens_), len(held), axis=1)
        assert not (windows == held).all(axis=1).any(), "a train sample holds the first version's eval text"
    evaluated = [(s, s + n) for _, segs, _ in split_arrays(tmp_path / "s", "eval")
                 for d, s, n in segs[:, [store.S_DOC, store.S_START, store.S_LENGTH]].tolist() if d == revision]
    covered = sum(max(0, min(e, first_start + first_size) - max(s, first_start)) for s, e in evaluated)
    # the first version's held-out part, and its own hashed piece #13 (past the first version's 40 lines) besides
    assert covered == first_size and max(e for _, e in evaluated) > len(story(40)), evaluated


def test_generated_text_is_the_whole_decoding_less_the_prompts_after_a_stray_byte(tmp_path, capsys):
    """A prompt given as raw ids whose byte-token run, begun with a stray byte (<0xE6>, the first of a 3-byte
    character) just before its last 8 ids, runs through them: the line's text is decode(prompt + tokens) less
    decode(prompt), as transformers' pipeline gives it (docs/generate.md), not the run's later bytes as text."""
    pytest.importorskip("tokenizers")
    from test_generate_audit2_stop_byte_runs import _llama_like

    from longctx.generate.output import Stream, continuation_text

    tok, ids = _llama_like(tmp_path / "tokenizer.json")
    b = {c: ord(c) for c in "abc\n"}  # (byte tokens <0x61>... are ids 0x61...)
    prompt = [ids["▁"], ids["Question:"], 0xE6, *[b["a"]] * 8]
    for tokens in ([b["b"]], [b["b"], ids["▁yes"]], [ids["▁yes"], b["c"]], [b["\n"], b["\n"], ids["▁no"]]):
        whole, before = tok.decode(prompt + tokens), tok.decode(prompt)
        assert whole.startswith(before)
        assert continuation_text(tok, prompt, tokens) == whole[len(before):], tokens
        stream = Stream(tok, [], prompt)  # (what --stream shows: the line's text, as it grows)
        for token in tokens:
            stream(0, token)
        stream.finish(whole[len(before):])
        assert capsys.readouterr().err == whole[len(before):] + "\n", tokens
    for tokens in ([b["b"]], [ids["▁yes"]]):  # (a prompt whose run is valid: as before)
        clean = [ids["▁"], ids["Question:"], *[b["a"]] * 9]
        assert continuation_text(tok, clean, tokens) == tok.decode(clean + tokens)[len(tok.decode(clean)):]
