"""benchmarks/peer_decode.py, issue 52's decode against transformers' static-cache generate (gpu_speed.sh step 4):
on CPU in fp32 both sides decode the same SmolLM2-shaped random model to the same tokens, and the JSON carries
the figures the GPU session reads. A lent device's minutes are few: a script that fails there loses its step."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_peer_decode_runs_and_both_sides_agree(tmp_path):
    out = tmp_path / "peer_decode.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_decode.py"), "--device", "cpu", "--layers", "1",
                    "--prompt-len", "16", "--new-tokens", "4", "--repeats", "1", "--out", str(out)],
                   check=True, env=env, capture_output=True, timeout=600)
    d = json.loads(out.read_text())
    assert d["same_tokens"] == 1.0  # (fp32: the same model read by both, greedy)
    assert d["compiled_calls"] > 0  # longctx decoded through its compiled step
    for side in ("longctx", "transformers"):
        assert d[side]["decode_tokens_per_s"] > 0 and len(d[side]["runs"]) == 1
    assert d["decode_ratio"] == d["longctx"]["decode_tokens_per_s"] / d["transformers"]["decode_tokens_per_s"]
