"""`bench attention --docs`: the plain causal reference (--causal-reference, on by default) is the S^2 one that a
long length kills; its process dying (the OOM killer: BrokenProcessPool) or refused memory lost every other
figure of the run to a traceback. It is now that reference's entry, the packed and per-document figures and the
storage peaks of those two kept; the ratios to it are left out. Another failure still raises."""

from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import pytest

from longctx.bench import attention_docs


def _fake_fresh(fail):
    calls = []

    def fresh(fn, args, ids, *rest):
        calls.append((fn.__name__, rest))
        if fn is attention_docs._tracked_peaks:
            return {kind: 1.0 for kind in rest[0]}
        if rest[0] == "causal":
            raise fail
        return {"fwd_bwd_cpu_s": 2.0, "plan_cpu_s": 0.1, "memory": {"rss_peak_growth_mib": 3.0}}
    return fresh, calls


def test_a_killed_causal_reference_keeps_the_other_figures(monkeypatch):
    fresh, calls = _fake_fresh(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    monkeypatch.setattr(attention_docs, "_fresh", fresh)
    args = SimpleNamespace(causal_reference=True, storage_tracker=True)
    single = attention_docs._single_process_kinds(args, None)
    assert "error" in single["causal"] and "--no-causal-reference" in single["causal"]["error"]
    assert single["packed"]["memory"] == {"rss_peak_growth_mib": 3.0, "tracked_peak_mib": 1.0}
    assert calls[-1] == ("_tracked_peaks", (("packed", "per_document"),))  # (not the reference that failed)
    ratios = attention_docs._memory_ratios(single)
    assert ratios["packed_memory_ratio_vs_causal_rss"] is None
    assert ratios["packed_memory_ratio_vs_per_document_rss"] == 1.0


def test_another_failure_of_the_reference_still_raises(monkeypatch):
    fresh, _ = _fake_fresh(RuntimeError("shape mismatch"))
    monkeypatch.setattr(attention_docs, "_fresh", fresh)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        attention_docs._single_process_kinds(SimpleNamespace(causal_reference=True, storage_tracker=False), None)
