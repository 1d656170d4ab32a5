"""A conversation cut after an answer that ends with the template's own EOS (Mistral's `answer</s>`) is stored
with that EOS as its one EOS: the shorter conversation is as long as the cut, not one more. So an answer whose
end meets --seq-len exactly fits, as the same shorter conversation stored alone does; the cut took the answer
before it instead (or dropped the conversation where no earlier answer fit), one token short of fitting."""

import pytest

pytest.importorskip("tokenizers")
from test_data_build import store_documents  # noqa: E402
from test_tok_audit_template_eos import LONG, _build, _rendered_ids, folder  # noqa: E402, F401


def test_a_cut_whose_answer_ends_with_the_eos_at_seq_len_keeps_that_answer(tmp_path, folder):  # noqa: F811
    kept = LONG[:4]
    whole, _ = _rendered_ids(folder, kept)
    seq_len = len(whole)  # (the two answers and their one </s>: a sample exactly)
    alone = store_documents(_build(tmp_path / "alone", folder, [kept], seq_len))
    assert alone[0] == whole  # (stored alone, it fits)
    cut = store_documents(_build(tmp_path / "cut", folder, [LONG], seq_len))
    assert cut[0] == whole, f"cut to {len(cut[0])} tokens, not the {len(whole)} of its first two answers"

