"""`longctx bench attention --docs` as a user runs it: packed documents vs each document alone vs
plain causal attention in one process, the distributed run with its layout, work imbalance, bytes."""

import json
import subprocess
import sys

from test_newcomer import longctx_here

from longctx.parallel.context.volumes import attention_bytes


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "longctx", "bench", "attention", *args], check=False,
                          capture_output=True, text=True, timeout=300)


def test_bench_attention_docs_reports_documents_memory_imbalance_and_bytes():
    out = _bench("--docs", "64", "--seq-len", "512", "--world", "2", "--ctx", "2", "--repeats", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["config"]["docs"] == "64" and doc["config"]["seq_balance"] == "docs" and doc["config"]["seq_len"] == 512
    assert doc["documents"]["count"] == 8 and doc["documents"]["length_max"] == 64

    single = doc["single_process"]
    assert set(single) == {"packed", "per_document", "causal"}
    assert single["per_document"]["calls"] == 8 and single["packed"]["calls"] == 1
    for kind, r in single.items():
        assert r["fwd_bwd_cpu_s"] > 0 and r["threads"] == 1, kind
        mem = r["memory"]
        # inputs, output, its gradient and the input gradients: 8 x (512 x 8 x 64 fp32 = 1 MiB) at least
        assert mem["rss_peak_growth_mib"] >= 8 and mem["tracked_peak_mib"] >= 8, (kind, mem)
        assert mem["tracked_peak_mib"] < 64, (kind, mem)
    assert single["packed"]["plan_cpu_s"] >= 0
    assert doc["single_per_document_fwd_bwd_cpu_s"] > 0 and doc["single_per_document_fwd_bwd_cpu_s_same_load"] > 0
    for key in ("packed_cpu_s_ratio_vs_per_document", "packed_with_plan_cpu_s_ratio_vs_per_document",
                "packed_memory_ratio_vs_causal_rss", "packed_memory_ratio_vs_causal_tracked",
                "cpu_s_ratio_vs_per_document", "cpu_s_ratio_vs_per_document_same_load", "cpu_s_ratio_vs_packed"):
        assert doc[key] > 0, key
    # the same tensors live at once with or without documents (no [S, S] mask, no big accumulators)
    assert 0.8 < doc["packed_memory_ratio_vs_causal_tracked"] < 1.25

    assert len(doc["per_rank"]) == 2 and doc["fwd_bwd_cpu_s_sum_over_ranks"] > 0
    imb = doc["work_imbalance"]
    assert imb["seq_balance"] == "docs" and imb["max_over_mean"] == imb["docs"]["max_over_mean"]
    for balance in ("docs", "zigzag"):
        assert imb[balance]["max_over_mean"] >= 1 and len(imb[balance]["rank_work"]) == 2
        # every rank's visible pairs add up to the documents' causal triangles
        assert sum(imb[balance]["rank_work"]) == doc["documents"]["visible_pairs"]
    assert [r["visible_pairs"] for r in doc["per_rank"]] == imb["docs"]["rank_work"]

    # with a layout, documents cost no bytes, and these 64-token documents each stay on one context rank: the
    # ring is skipped, nothing is sent (the closed form says so, to the byte)
    expected = attention_bytes(seq=512, batch=1, heads=8, kv_heads=8, head_dim=64, head=1, ctx=2, elem=4, docs=False,
                               docs_stay=True)
    assert expected == {}
    assert doc["bytes_closed_form"] == expected and doc["bytes_match_closed_form"]
    assert all(r["bytes"] == expected for r in doc["per_rank"])
    assert {"loadavg_1m_start", "pytest_processes_start"} <= set(doc["machine"])


def test_bench_attention_docs_refuses_a_bad_document_length():
    out = longctx_here("bench", "attention", "--docs", "none", "--seq-len", "512")  # (refused before work: here)
    assert out.returncode != 0 and "--docs takes a document length" in out.stderr
