"""`longctx eval --mode score` at its seams with Mixture-of-Experts models and packed data stores, against
transformers' own Qwen2-MoE (dropless, shared expert behind its sigmoid gate) on the same hf:DIR weights,
one sequence at a time (its experts run float32 only), the NLL written out here in float64.

- A capacity (moe.capacity_factor > 0) is shared by a forward's tokens: eval scores dropless (docs/eval.md),
  so ppl and passkey figures are each sequence's alone at --batch 1 and 3 (the last batch filled with unscored
  copies), under expert parallelism (ep 2 over ctx 2, ep 2 over dp 2) and on one process. Kept, the same
  capacity changes them (the fixture's routers drop tokens): the comparison can fail. The JSON's layout
  names the expert degree (the other degrees do not show it).
- A packed store (documents cut and packed into samples of 64 tokens with bfd): ppl's spans are runs of one
  document (its tokens and EOS, checked against the source files), never across a boundary, and score as
  that span alone; the token count is the scored tokens (length - 1 per span).
- Evaluation holds no training state: routers record nothing, no buffer moves (the aux-loss-free bias), and a
  second pass is bit-identical to the first.
- The training run's periodic eval (train/trainer.py) of a capacity model: dropless, the same under any grad_accum.
"""

import dataclasses

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from longctx.cli import build_parser  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.data.builder.options import BuildOptions  # noqa: E402
from longctx.data.builder.pipeline import build_store  # noqa: E402
from longctx.data.tokenizer import load_tokenizer  # noqa: E402
from longctx.eval.request import prepare  # noqa: E402
from longctx.eval.score_mode import _prefix, _prefixed, evaluate_score  # noqa: E402
from longctx.models.llama import build_model  # noqa: E402
from longctx.models.moe import moe_layers  # noqa: E402

# (not slow: ~18 s on 2 idle cores in all, no test past 10 s; each task's two 2-rank layouts in one spawned job)
QWEN = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=1024,
            tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32", initializer_range=0.1,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            intermediate_size=80, norm_topk_prob=False, use_sliding_window=False)
LENGTH = 128
CAPACITY = "--model.moe.capacity_factor=1.0"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho sigma tau".split()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(hf:DIR of a random Qwen2-MoE written by transformers, the packed store, {document name: its byte ids + EOS},
    transformers' model)."""
    tmp = tmp_path_factory.mktemp("moe_packed")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**QWEN)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routers of some conviction: a capacity then drops tokens
    hf.save_pretrained(tmp / "hf")
    src, rng = tmp / "docs", np.random.default_rng(0)
    src.mkdir()
    for i in range(16):  # documents shorter and longer than the spans, cut by the 64-token samples
        n = int(rng.choice([15, 40, 90, 160]))
        (src / f"d{i:02d}.txt").write_text(f"doc {i}: " + " ".join(rng.choice(WORDS, n)))
    store = tmp / "store"
    build_store(BuildOptions([str(src)], str(store), 64, strategy="bfd", dedup="none", workers=1, eval_fraction=0.5,
                             holdout_tokens=400, stats=False, progress=False), log=lambda *a, **k: None)
    tok = load_tokenizer("byte")
    docs = {p.name: np.append(np.asarray(tok.encode_batch([p.read_text()])[0]), tok.eos_id) for p in src.iterdir()}
    return tmp / "hf", store, docs, hf


def _args(folder, task: str, *extra):
    hf, store = folder[:2]
    more = ["--depths", "0,0.5,1", "--samples", "2"] if task != "ppl" else ["--samples", "5", "--buckets", "4"]
    return build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--task", task, "--lengths", str(LENGTH), *more,
         "--data", str(store), CAPACITY, *extra])


def _run(folder, task: str, *extra, nproc: int = 1, capacity: float = 0.0):
    args, rest = _args(folder, task, *extra)
    request = prepare(args, rest, nproc)
    if capacity:  # (the capacity eval leaves out, put back: what the figures would be without `dropless`)
        request.cfg = dataclasses.replace(request.cfg, model=dataclasses.replace(request.cfg.model,
                                                                                 moe_capacity_factor=capacity))
    return request, evaluate_score(request, args)


def _on_ranks(folder, task: str, extra: list[str]):
    request, out = _run(folder, task, *extra, nproc=2)
    return (_prefixed(request, LENGTH, _prefix(request)), out) if out is not None else None


@torch.no_grad()
def _alone(hf, seq) -> tuple[float, int, int]:
    """transformers on this one sequence: (NLL sum over its labels, labels, labels not the argmax), float64."""
    logits = hf(torch.as_tensor(seq.tokens)[None]).logits[0].double()
    labels = torch.as_tensor(seq.labels)
    valid = labels != -100
    nll = logits.logsumexp(-1) - logits.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return float(nll[valid].sum()), int(valid.sum()), int(((logits.argmax(-1) != labels) & valid).sum())


def _check(out, seqs, hf, task: str, tol: float = 2e-5):
    ref = [_alone(hf, s) for s in seqs]
    if task == "ppl":
        (r,) = out["results"]
        assert r["sequences"] == len(seqs) and r["tokens"] == sum(n for _, n, _ in ref) == len(seqs) * (LENGTH - 1)
        assert r["loss"] == pytest.approx(sum(s for s, _, _ in ref) / r["tokens"], abs=tol)
        return
    for r in out["results"]:
        idx = [i for i, s in enumerate(seqs) if s.depth == r["depth"]]
        assert r["answer_nll"] == pytest.approx(sum(ref[i][0] for i in idx) / sum(ref[i][1] for i in idx), abs=tol)
        assert r["per_sample"] == [ref[i][2] == 0 for i in idx]


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_a_capacity_model_scores_each_sequence_alone_at_any_batch_and_layout(folder, task):
    from longctx.job.spawn import run_spawned_many

    hf = folder[3]
    runs = {b: _run(folder, task, "--batch", str(b)) for b in (1, 3)}
    seqs = _prefixed(runs[1][0], LENGTH, _prefix(runs[1][0]))
    for request, out in runs.values():
        assert request.cfg.model.moe_capacity_factor == 0.0 and "dropless" in out["routing"]
        _check(out, seqs, hf, task)
    # the capacity, kept, would make the figures depend on the batch: what the comparison above guards
    kept = {b: _run(folder, task, "--batch", str(b), capacity=1.0)[1]["results"] for b in (1, 3)}
    key = "loss" if task == "ppl" else "answer_nll"
    assert max(abs(x[key] - y[key]) for x, y in zip(kept[1], kept[3])) > 1e-3
    layouts = {"ep2-ctx2": ["--parallel.expert=2", "--batch", "2"],
               "ep2-dp2": ["--parallel.dp_shard=2", "--parallel.expert=2", "--batch", "4"]}
    spawned = run_spawned_many(2, [(name, _on_ranks, (folder, task, extra)) for name, extra in layouts.items()])
    for name in layouts:
        (theirs, out), none = spawned[name]
        assert none is None and out["layout"]["world"] == 2 and out["layout"]["expert"] == 2
        assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(theirs, seqs)), name
        _check(out, seqs, hf, task)


def test_packed_store_spans_stay_inside_one_document(folder):
    """Each ppl span is a run of one source document (its byte ids, EOS last): no span reads across a boundary of
    the packed samples' documents (64 tokens each: every span was cut over several of them and reassembled)."""
    request, _ = _run(folder, "ppl", "--samples", "8")
    spans = request.sequences[LENGTH]
    docs = folder[2]
    for s in spans:
        homes = [n for n, d in docs.items() if any(np.array_equal(d[i:i + LENGTH], s.tokens)
                                                    for i in range(len(d) - LENGTH + 1))]
        assert homes, "a span that is no run of one document"
        assert np.array_equal(s.labels[:-1], s.tokens[1:]) and s.labels[-1] == -100
    assert len(spans) >= 5  # (the store's eval split holds enough for the scoring test's --samples 5)


def test_evaluation_holds_no_training_state():
    """A trained-looking sigmoid-router model (aux-loss-free bias set) in eval mode: no router statistics are
    recorded, no buffer or weight moves, and two passes agree bit for bit, batched or one row at a time."""
    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.layers=2", "--model.moe.dense_layers=",
                                 "--model.moe.router=sigmoid", "--model.moe.groups=2", "--model.moe.topk_groups=1",
                                 "--model.moe.bias_update_rate=0.01", "--model.moe.aux_loss=0.01",
                                 "--model.moe.z_loss=0.001"]).model
    model = build_model(cfg, seed=0)
    for i, layer in enumerate(moe_layers(model)):
        layer.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, cfg.moe_experts) * (i + 1))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, cfg.vocab_size, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first, second = (model(tokens, labels=tokens, loss_reduction="tokens") for _ in range(2))
        rows = torch.cat([model(tokens[i:i + 1], labels=tokens[i:i + 1], loss_reduction="tokens") for i in range(3)])
    assert torch.equal(first, second)
    assert torch.allclose(first, rows, atol=1e-5)
    assert all(not layer.records for layer in moe_layers(model)) and model.router_terms() is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _training_eval(run_dir, store, capacity: float, grad_accum: int) -> float:
    from longctx.train.trainer import Trainer

    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.layers=2", "--model.moe.dense_layers=",
                                 f"--model.moe.capacity_factor={capacity}", f"--data.path={store}",
                                 "--train.seq_len=64", "--train.global_batch=4", f"--train.grad_accum={grad_accum}",
                                 "--train.eval_interval=1", "--train.eval_batches=2", "--train.steps=1",
                                 f"--train.run_dir={run_dir}", "--metrics.plots=false", "--metrics.progress=false"])
    return Trainer(cfg, log=lambda *a, **k: None).evaluate()


def test_training_eval_loss_of_a_capacity_model_does_not_depend_on_grad_accum(folder, tmp_path):
    """Trainer.evaluate promises the same loss under any grad_accum; with a capacity its micro-batch (global batch /
    grad_accum sequences) shares each expert's room. Reference: the same weights evaluated dropless (capacity 0)."""
    store = folder[1]
    reference = _training_eval(tmp_path / "dropless", store, 0.0, 1)
    for grad_accum in (1, 4):
        loss = _training_eval(tmp_path / f"ga{grad_accum}", store, 1.0, grad_accum)
        assert loss == pytest.approx(reference, abs=1e-5), grad_accum
