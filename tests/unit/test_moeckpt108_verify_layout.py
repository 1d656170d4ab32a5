"""`longctx checkpoint verify` says an expert-parallel checkpoint's layout as the training line does
(checkpoint/verify_command.py layout_text, train/run_lines.py describe_run): the expert degree is folded over
the ranks data x head x ctx already use. It was printed as one more factor, "2 ranks: dp_replicate 1 x dp_shard 2
x head 1 x ctx 1 x expert 2", whose factors multiply to 4 ranks for a checkpoint of 2."""

import math
import re

from longctx.checkpoint.verify_command import layout_text

# what train/setup.py open_checkpointing records for debug-moe under --parallel.expert=2 on 2 ranks
SAVED = {"world": 2, "dp_replicate": 1, "dp_shard": 2, "head": 1, "ctx": 1, "window": 0, "placement": "head-first",
         "expert": 2}


def test_the_expert_degree_is_said_folded_over_the_ranks():
    text = layout_text(SAVED)
    assert text == "2 ranks: dp_replicate 1 x dp_shard 2 x head 1 x ctx 1, head-first (expert 2 folded over them)"
    factors = [int(n) for n in re.findall(r"(?:^|x )\w+ (\d+)", text.split(": ", 1)[1].split(",")[0])]
    assert math.prod(factors) == SAVED["world"]


def test_expert_1_and_unknown_degrees():
    assert layout_text({**SAVED, "expert": 1}) == "2 ranks: dp_replicate 1 x dp_shard 2 x head 1 x ctx 1, head-first"
    assert layout_text({**SAVED, "expert": 1, "pipeline": 3}).startswith(
        "2 ranks: dp_replicate 1 x dp_shard 2 x head 1 x ctx 1 x pipeline 3")
