"""benchmarks/shared_copy_check.py (gpu_speed.sh's step 8) on CPU with dynamo's eager backend: its models decode
their own tokens through one shared copy, and its JSON says so (on a GPU it runs reduce-overhead)."""

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "shared_copy_check.py"


def test_shared_copy_check_runs_on_cpu_and_reports_one_graph(tmp_path):
    from longctx.models import compiled_copies

    spec = importlib.util.spec_from_file_location("shared_copy_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch._dynamo.reset()
    compiled_copies.COPIES.clear()
    try:
        out = tmp_path / "shared.json"
        result = module.main(["--device", "cpu", "--backend", "eager", "--new-tokens", "6", "--out", str(out)])
    finally:
        compiled_copies.COPIES.clear()
        torch._dynamo.reset()
    assert json.loads(out.read_text()) == result
    assert result["all_identical"] and len(result["rows"]) == 2 * len(module.VARIANTS)
    assert result["tokens_differ_between_variants"] >= 4  # (else the check could not see stale frequencies)
    assert result["graphs"] == 1 and result["copies"] == 1, result
