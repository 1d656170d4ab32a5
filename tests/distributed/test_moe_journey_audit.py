"""A Mixture-of-Experts user's journey across the seams between features, each step checked against
transformers or one process: tiny random Qwen2-MoE and Mixtral models written by transformers' save_pretrained
(4 experts, with a BPE tokenizer), imported (`hf:DIR`: logits = transformers'), trained under expert
parallelism folded on the 2D mesh with a checkpoint at step 3 (losses = one process), resumed under another
layout (steps 4-6 = the uninterrupted run; the aux-loss-free selection bias carried), exported
(`longctx checkpoint export`: transformers' logits on the export = the checkpoint's, the MoE keys of
config.json) and generated from (`longctx generate` on the checkpoint = transformers' greedy generate on the
export). What a user varies: top-1 / top-2, norm_topk_prob, a shared expert and a dense layer, a capacity
(half the choices dropped), the selection bias, FlexMoE's copies. One 4-rank job holds the expert-parallel runs
and their resumes.

Found by this audit: at top-1 with renormalisation (Mixtral top-1, norm_topk_prob) the weight p / p is 1 but
autograd gave the router a gradient of rounding noise (~1e-10), which Adam scaled into router updates that each
layout's summation order pointed elsewhere: with a capacity the top-1 Mixtral's losses went 2.7e-2 off one
process by step 6 (4.6e-2 at capacity 1), and its logits 8.3 off the one-process run's (models/moe.py now gives
an exactly zero gradient); and the export left a capacity out of config.json without a word, so transformers
ran dropless what trained with half its choices dropped (checkpoint/export.py now says so)."""

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longctx.checkpoint.export import export_hf  # noqa: E402
from longctx.config import load_config  # noqa: E402
from longctx.job.spawn import run_spawned_many  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "e2e"))
sys.path.insert(0, str(TESTS / "unit"))
sys.path.insert(0, str(TESTS / "distributed"))
from test_newcomer import longctx_here  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402
from test_user_journey_audit import _prompt, save_hf_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH, VOCAB = 128, 300
BASE = ["--train.steps=6", "--train.global_batch=4", f"--train.seq_len={LENGTH}", "--train.lr=3e-3",
        "--train.warmup_steps=1", "--train.eval_interval=0", "--data.max_docs=60", "--metrics.plots=false",
        "--metrics.progress=false", "--metrics.log_interval=1", "--checkpoint.interval=3", "--checkpoint.keep=2"]
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
              rms_norm_eps=1e-6, max_position_embeddings=LENGTH, initializer_range=0.25, hidden_act="silu",
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, rope_theta=10000.0)
# name: (family, config keys, training args, expert-parallel layout (4 ranks), the resume's layout)
JOURNEYS = {
    # a gated shared expert, a dense layer, top 2 unnormalised, transformers' pooled balancing loss
    "qwen2-shared-top2": ("qwen2_moe", dict(num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                                            output_router_logits=True, router_aux_loss_coef=0.02), [],
                          ["--parallel.expert=2", "--parallel.ctx=2"], ["--parallel.head=2", "--parallel.ctx=2"]),
    # top 1 (weights renormalised to 1), a capacity of half an even share: half the choices dropped, or more
    "mixtral-top1-capacity": ("mixtral", dict(num_experts_per_tok=1), ["--model.moe.capacity_factor=0.5"],
                              ["--parallel.expert=4", "--parallel.head=2", "--parallel.ctx=2"],
                              ["--parallel.expert=2", "--parallel.ctx=2"]),
    # top 2 renormalised, the aux-loss-free selection bias, FlexMoE's copies of hot experts
    "qwen2-norm-bias-flexmoe": ("qwen2_moe", dict(num_experts_per_tok=2, norm_topk_prob=True),
                                ["--model.moe.bias_update_rate=0.05"],
                                ["--parallel.expert=2", "--parallel.ctx=2", "--parallel.expert_replicas=1",
                                 "--parallel.expert_placement_window=2"],
                                ["--parallel.expert=4", "--parallel.ctx=4", "--parallel.expert_replicas=1",
                                 "--parallel.expert_placement_window=2"]),
}
EXPORTED = [name for name in JOURNEYS if "bias" not in name]  # (transformers' routers have no selection bias)
CAPACITY = "mixtral-top1-capacity"


def _source(d: Path, family: str, keys: dict, tokenizer: Path) -> Path:
    """A random model written by transformers' save_pretrained, with the BPE tokenizer."""
    torch.manual_seed(0)
    if family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, use_sliding_window=False, **keys))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, intermediate_size=32,
                                                                           num_local_experts=4, **keys))
    return save_hf_dir(model, d, tokenizer, LENGTH)


def _train(args, run_dir):
    """(losses, the routers' selection bias after the run [layers, E])."""
    from longctx.models.moe import moe_layers
    from longctx.train.trainer import Trainer

    cfg = load_config(None, [*BASE, *args, f"--train.run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    losses = list(trainer.run().losses)
    bias = [m.router.expert_bias.detach().double().tolist() for m in moe_layers(trainer.model)]
    trainer.sampler.close()
    return losses, bias


@pytest.fixture(scope="module")
def journeys(tmp_path_factory):
    """{name: (source, one-process run, expert-parallel run, losses one / ep / resumed, biases one / resumed)}:
    6 steps in one process and under the expert-parallel layout (saving steps 3 and 6), then from the latter's
    step 3 under the resume's layout (run directory ep_resumed, checkpoints in ep/b)."""
    base = tmp_path_factory.mktemp("moe_journey")
    tokenizer = bpe_tokenizer(base / "tokenizer.json")
    out, jobs = {}, []
    for name, (family, keys, train_args, layout, resume) in JOURNEYS.items():
        source = _source(base / f"{name}_hf", family, keys, tokenizer)
        args = [f"--model.init_from=hf:{source}", *train_args]
        one, ep = base / f"{name}_one", base / f"{name}_ep"
        out[name] = source, one, ep, _train(args, one)
        jobs.append((f"{name} ep", _train, ([*args, *layout], str(ep))))
        resumed = [*args, *resume, f"--checkpoint.resume={ep}/checkpoints/step-00000003", f"--checkpoint.dir={ep}/b"]
        jobs.append((f"{name} resume", _train, (resumed, f"{ep}_resumed")))
    spawned = run_spawned_many(4, jobs)
    return {name: (*out[name][:3], out[name][3], spawned[f"{name} ep"], spawned[f"{name} resume"])
            for name in JOURNEYS}


def _ours(path):
    from longctx.checkpoint.manifest import read_manifest
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.config.checkpoint_paths import find_checkpoint
    from longctx.config.hf import model_config
    from longctx.models.llama import build_model

    path = find_checkpoint(path)
    model = build_model(model_config(read_manifest(path)["model"]), device="cpu", seed=None)
    load_model_weights(path, model)
    return model.eval()


def _theirs(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


TOKENS = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", JOURNEYS)
def test_import_computes_transformers_logits(journeys, name):
    from longctx.models.hf import load_hf

    source = journeys[name][0]
    with torch.no_grad():
        err = (load_hf(source).eval()(TOKENS) - _theirs(source)(TOKENS).logits).abs().max().item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("name", JOURNEYS)
def test_expert_parallel_and_resumed_runs_train_as_one_process(journeys, name):
    _, _, _, (one, one_bias), ep, resumed = journeys[name]
    ep_diff = max(abs(a - b) for losses, _ in ep for a, b in zip(losses, one, strict=True))
    resumed_diff = max(abs(a - b) for losses, _ in resumed for a, b in zip(losses, one[3:], strict=True))
    bias_diff = max(abs(a - b) for _, bias in resumed for x, y in zip(bias, one_bias) for a, b in zip(x, y))
    print(f"{name}: max |loss - one process| {ep_diff:.2e} expert-parallel, {resumed_diff:.2e} resumed; "
          f"selection bias {bias_diff:.2e} (|bias| {max(abs(b) for x in one_bias for b in x):.2f})")
    assert len(one) == 6 and one[-1] < one[0]
    assert ep_diff <= 1e-4 and resumed_diff <= 1e-4 and bias_diff <= 1e-6
    # the router's figures of steps 4-6 (loads, balancing losses, drops, the bias's norm) as one process's
    from longctx.train.metrics import read_jsonl

    ep_dir = journeys[name][2]
    rows = [{r["step"]: r for r in read_jsonl(d / "metrics.jsonl") if r.get("kind") == "train"}
            for d in (journeys[name][1], ep_dir.with_name(ep_dir.name + "_resumed"))]
    keys = sorted(k for k in rows[0][4] if k.startswith("moe_"))
    assert rows[1].keys() == {4, 5, 6} and "moe_load_worst" in keys and ("moe_bias_norm" in keys) == ("bias" in name)
    assert (rows[0][4]["moe_drop_rate"] >= 0.5) == (name == CAPACITY)  # (half the choices dropped, or more)
    flat = lambda v: torch.tensor(v, dtype=torch.float64).flatten().tolist()  # noqa: E731  (per-layer lists too)
    worst = max(abs(a - b) for s in (4, 5, 6) for k in keys for a, b in zip(flat(rows[0][s][k]), flat(rows[1][s][k]),
                                                                             strict=True))
    print(f"{name}: router figures of steps 4-6 {keys}: max |resumed - one process| {worst:.2e}")
    assert worst <= 1e-4
    if "bias" in name:
        assert max(abs(b) for x in one_bias for b in x) > 0.1  # the bias moved (and so routed the resumed steps)


@pytest.fixture(scope="module")
def exports(journeys, tmp_path_factory):
    """{name: (export dir, notes)}: `longctx checkpoint export` of the resumed run's step 6."""
    base = tmp_path_factory.mktemp("moe_exports")
    out = {}
    for name in EXPORTED:
        export, _, _, notes = export_hf(journeys[name][2] / "b", base / name)
        out[name] = export, notes
    return out


@pytest.mark.parametrize("name", EXPORTED)
def test_export_carries_the_moe_keys_transformers_reads(journeys, exports, name):
    source, export = journeys[name][0], exports[name][0]
    theirs, ours = json.loads((source / "config.json").read_text()), json.loads((export / "config.json").read_text())
    keys = ["model_type", "num_experts_per_tok", "hidden_size", "num_hidden_layers", "num_key_value_heads",
            "rms_norm_eps", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id"]
    keys += (["num_local_experts", "intermediate_size", "router_jitter_noise"] if JOURNEYS[name][0] == "mixtral" else
             ["num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
              "mlp_only_layers", "decoder_sparse_step", "qkv_bias", "intermediate_size"])
    keys += ["output_router_logits", "router_aux_loss_coef"] if theirs.get("output_router_logits") else []
    assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}
    assert ours.get("output_router_logits", False) == theirs.get("output_router_logits", False)
    config = transformers.AutoConfig.from_pretrained(export)
    assert (config.num_experts_per_tok, config.rope_parameters["rope_theta"]) == (theirs["num_experts_per_tok"], 1e4)


@pytest.mark.parametrize("name", EXPORTED)
def test_transformers_on_the_export_computes_the_checkpoint(journeys, exports, name):
    """transformers routes dropless; so do longctx's eval and generate (`dropless`, which a capacity's run notes)."""
    from longctx.models.moe_eval_routing import dropless

    source, one, ep, *_ = journeys[name]
    model, single = _ours(ep / "b"), _ours(one / "checkpoints")
    with torch.no_grad(), dropless(model), dropless(single):
        reference = _theirs(exports[name][0])(TOKENS).logits
        err = (model(TOKENS) - reference).abs().max().item()
        err_one = (single(TOKENS) - reference).abs().max().item()  # (the one-process run's step 6)
        moved = (_theirs(source)(TOKENS).logits - reference).abs().max().item()
    print(f"{name}: export max |logits - checkpoint| {err:.2e}, - one process's {err_one:.2e} (trained away from "
          f"the source by {moved:.2f})")
    assert err <= 1e-4 and err_one <= 2e-3 and moved > 1e-2


@pytest.mark.parametrize("name", EXPORTED)
def test_greedy_generation_of_the_checkpoint_is_transformers_on_the_export(journeys, exports, name):
    export = exports[name][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    theirs = _theirs(export)
    for length, new in ((12, 40), (50, 30)):
        prompt = _prompt(tokenizer, length)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            reference = theirs.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert len(set(reference)) > 3
        for checkpoint in (journeys[name][2] / "b", f"hf:{export}"):
            r = longctx_here("generate", "--checkpoint", checkpoint, "--prompt", prompt, "--max-new-tokens", new,
                             "--ignore-eos")
            assert r.returncode == 0, r.stderr
            line = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
            assert line["prompt_tokens"] == ids.shape[1] and line["tokens"] == reference, (name, length, checkpoint)


def test_the_export_says_the_capacity_it_leaves_out(exports):
    """The capacity journey's training forwards dropped half the choices; config.json has no capacity, so
    transformers computes the export dropless (the checkpoint's logits with the capacity are far from them):
    the export says so, as eval and generate do. No capacity, no such note."""
    capacity = [n for n in exports[CAPACITY][1] if "capacity_factor" in n]
    assert len(capacity) == 1 and "transformers runs the export dropless" in capacity[0], exports[CAPACITY][1]
    assert not any("capacity_factor" in n for n in exports["qwen2-shared-top2"][1])


def test_a_selection_bias_is_refused_by_the_export_not_dropped(journeys, tmp_path):
    from longctx.config.hf import HFFormatError

    with pytest.raises(HFFormatError, match="expert_bias is not zero"):
        export_hf(journeys["qwen2-norm-bias-flexmoe"][2] / "b", tmp_path / "export")
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("router", ["softmax", "sigmoid", "dts"])
def test_a_renormalised_top1_weight_gives_the_router_no_gradient(router):
    """At top-1 with moe.norm_topk the weight is p / p = 1 whatever the logits: its gradient is 0 (by hand).
    Autograd's p / p left rounding noise (~1e-10), which Adam scaled up to layout-dependent router updates:
    the top-1 Mixtral journey's losses under expert 4 x head 2 x ctx 2 went 4.6e-2 off one process."""
    from longctx.models.moe import ROUTERS

    cfg = load_config(None, ["--model.preset=debug-moe", "--model.moe.top_k=1", "--model.moe.norm_topk=true",
                             f"--model.moe.router={router}"]).model
    torch.manual_seed(0)
    gate = ROUTERS[router](cfg)
    gate.step = cfg.moe_dts_steps  # (DTS-Gate: its schedule ended, top 1)
    torch.nn.init.normal_(gate.gate.weight, std=0.5)
    routing = gate(torch.randn(256, cfg.dim))
    assert routing.experts.shape == (256, 1) and torch.equal(routing.weights, torch.ones_like(routing.weights))
    if routing.weights.requires_grad:  # (a constant 1 has no gradient at all)
        (routing.weights * torch.randn_like(routing.weights)).sum().backward()
    assert gate.gate.weight.grad is None or not gate.gate.weight.grad.any()


def test_generation_routes_with_the_trained_selection_bias(journeys):
    """`longctx generate` on the resumed expert-parallel checkpoint = a greedy loop of full forwards of the one-process
    run's step 6 (the same selection bias, which moves the tokens: without it they differ)."""
    from longctx.models.moe import moe_layers

    source, one, ep, *_ = journeys["qwen2-norm-bias-flexmoe"]
    model = _ours(one / "checkpoints")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    prompt = _prompt(tokenizer, 20)
    ids = tokenizer(prompt, return_tensors="pt").input_ids

    def greedy(new=30):
        out = ids
        with torch.no_grad():
            for _ in range(new):
                out = torch.cat([out, model(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return out[0, ids.shape[1]:].tolist()

    reference = greedy()
    r = longctx_here("generate", "--checkpoint", ep / "b", "--prompt", prompt, "--max-new-tokens", 30, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])["tokens"] == reference
    for layer in moe_layers(model):
        layer.router.expert_bias.zero_()
    assert greedy() != reference


def test_eval_scores_the_checkpoint_as_the_export(journeys, exports, tmp_path):
    """`longctx eval --task ppl` of the capacity run's checkpoint = of its export (whose logits are transformers'):
    eval routes dropless, as transformers does."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x + {i}\nclass A{i}:\n    pass\n" for i in range(200)))
    scores = []
    for checkpoint in (journeys[CAPACITY][2] / "b", f"hf:{exports[CAPACITY][0]}"):
        out = tmp_path / f"eval{len(scores)}.json"
        r = longctx_here("eval", "--checkpoint", checkpoint, "--task", "ppl", "--lengths", LENGTH, "--samples", 2,
                         "--data", text, "--output", out)
        assert r.returncode == 0, r.stderr
        scores.append(json.loads(out.read_text()))
    print({k: v for k, v in scores[0].items() if k not in ("tokenizer", "seconds", "checkpoint", "model")})
    # each length's record carries its wall time, which no two runs share
    untimed = [[{k: v for k, v in row.items() if k != "seconds"} for row in s["results"]] for s in scores]
    assert untimed[0] == untimed[1]
