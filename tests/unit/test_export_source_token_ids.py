"""An export of a run that started from a Hugging Face model writes the source's special token ids: those its
config.json names, and no other. A source naming EOS alone reads BOS as its class's default (LlamaConfig: 1);
the export wrote bos_token_id = null, so transformers read the exported model with no BOS where it had read
the source with one."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from longctx.checkpoint.export import special_token_ids  # noqa: E402


@pytest.mark.parametrize("named", [{"eos_token_id": 5}, {"bos_token_id": 4, "eos_token_id": [5, 7]},
                                   {"eos_token_id": 5, "pad_token_id": None}])
def test_the_export_reads_the_special_ids_the_source_read(tmp_path, named):
    source = tmp_path / "src"
    source.mkdir()
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, **named}
    (source / "config.json").write_text(json.dumps(config))
    ids, note = special_token_ids({"model": {"init_from": f"hf:{source}"}})
    assert note == ""
    exported = tmp_path / "out"
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k not in named}, **ids}))
    theirs, ours = (transformers.AutoConfig.from_pretrained(d) for d in (source, exported))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
