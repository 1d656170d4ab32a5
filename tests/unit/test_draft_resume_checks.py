"""checkpoint/manifest.py check_draft_matches: a run resumes only a checkpoint of its own kind (a model, or
a draft of the same kind, layers and vocabulary), refused before anything is loaded, the error naming
what differs and the flags that match it."""

from pathlib import Path

import pytest

from longctx.checkpoint.manifest import check_draft_matches
from longctx.config.checkpoint_paths import CheckpointError

WHERE = Path("runs/d/checkpoints/step-00000010")
GLIDE = {"draft": {"kind": "glide", "layers": 1, "vocab": 8192, "target": {"path": "/m"}}}
OLD_GLIDE = {"draft": {"kind": "glide", "layers": 2, "target": {"path": "/m"}}}  # (before kind and vocab)


def test_the_same_draft_and_a_model_resume():
    check_draft_matches(GLIDE, 1, WHERE, "glide", 8192)
    check_draft_matches(OLD_GLIDE, 2, WHERE)
    check_draft_matches({}, None, WHERE)


@pytest.mark.parametrize("manifest, layers, kind, vocab, said", [
    (GLIDE, None, "glide", 0, "holds a glide draft .* not a model"),
    ({}, 1, "glide", 0, "holds a model, not a draft"),
    (GLIDE, 1, "clover", 8192, r"draft.kind 'glide' \(this run: 'clover'\); set --draft.kind glide"),
    (GLIDE, 1, "glide", 0, r"draft.vocab 8192 \(this run: 0\); set --draft.vocab 8192"),
    (OLD_GLIDE, 1, "glide", 0, r"draft.layers 2 \(this run: 1\); set --draft.layers 2"),
])
def test_another_kind_is_refused_naming_the_difference(manifest, layers, kind, vocab, said):
    with pytest.raises(CheckpointError, match=said):
        check_draft_matches(manifest, layers, WHERE, kind, vocab)
