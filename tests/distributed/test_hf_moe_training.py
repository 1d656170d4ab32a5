"""Start from a Hugging Face Mixture of Experts under a parallel layout: each rank materialises only
its experts' rows (from either expert layout), training matches one process step by step, and the
checkpoint exports to what transformers reproduces. The 4-rank loads and the 4-rank training run
share one spawned job (run_spawned_many)."""

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from longctx.config import load_config  # noqa: E402
from longctx.job.spawn import run_spawned_many  # noqa: E402
from longctx.train.trainer import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
# (`longctx checkpoint export` in this process: the test reads the files it writes, and a new interpreter's
# imports cost seconds)
from test_newcomer import longctx_here  # noqa: E402

STEPS = 6
BASE = [f"--train.steps={STEPS}", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=300", "--train.seq_len=256", "--train.lr=1e-3",
        "--data.tokenizer=byte"]  # (the random model has no tokenizer.json: its tokenizer is named)
# a Qwen2-MoE with a dense layer (mlp_only_layers), a gated shared expert and 8 experts, top 2; trained
# with transformers' pooled balancing loss (output_router_logits: without it there would be none)
QWEN2_MOE = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
                 intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0], num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=320, rms_norm_eps=1e-6,
                 max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
                 router_aux_loss_coef=0.01, output_router_logits=True, torch_dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _write(d: Path, layout: str) -> Path:
    cfg = transformers.Qwen2MoeConfig(**QWEN2_MOE)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    # several files, so that one layer's experts are spread over more than one
    model.save_pretrained(d, max_shard_size="60KB", save_original_format=layout == "per_expert")
    assert (d / "model.safetensors.index.json").is_file()
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return d


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """The same random tiny Qwen2-MoE written by transformers per expert and fused."""
    return {layout: _write(tmp_path_factory.mktemp(layout), layout) for layout in ("per_expert", "fused")}


def _sharded_load(path):
    """Build the training model of a 4-rank dp_shard layout; report this rank's materialised numbers
    of elements (all, and of the routed experts) and its weights gathered back to full tensors."""
    import torch.distributed as dist

    from longctx.job.runtime import Runtime
    from longctx.train.model import build_training_model

    cfg = load_config("configs/debug.toml", [*BASE, f"--model.init_from=hf:{path}"])
    rt = Runtime.create(cfg, dist.get_rank(), dist.get_world_size(), "cpu")
    model = build_training_model(cfg, torch.device("cpu"), rt, log=lambda *a: None)
    local = sum(p.to_local().numel() for p in model.parameters())
    experts = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if ".experts." in n}
    # numpy, not tensors: torch's queue shares tensors through file descriptors that die with the rank
    full = {n: p.detach().full_tensor().numpy().copy() for n, p in model.named_parameters()}
    bias = [b.abs().sum().item() for n, b in model.named_buffers() if n.endswith("expert_bias")]
    return local, experts, full, bias


PARALLEL = ["--parallel.head=2", "--parallel.ctx=2", f"--checkpoint.interval={STEPS}"]


@pytest.fixture(scope="module")
def spawned(moe_dirs, tmp_path_factory):
    """One 4-rank job: _sharded_load of either expert layout, then head 2 x ctx 2 training from the
    per-expert one (run directory `parallel`); ({key: per-rank results}, the training's run directory)."""
    run_dir = tmp_path_factory.mktemp("parallel")
    jobs = [*((f"load {layout}", _sharded_load, (str(moe_dirs[layout]),)) for layout in ("per_expert", "fused")),
            ("train", _train, ([f"--model.init_from=hf:{moe_dirs['per_expert']}", *PARALLEL], str(run_dir)))]
    return run_spawned_many(4, jobs), run_dir


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_each_rank_materialises_only_its_experts(moe_dirs, layout, spawned):
    from longctx.models.hf import load_hf

    reference = load_hf(moe_dirs[layout])
    total = sum(p.numel() for p in reference.parameters())
    results = spawned[0][f"load {layout}"]
    for local, experts, full, bias in results:
        assert local <= total / 4 + 2 * 96 * 4  # a quarter, give or take one row per tensor of uneven length
        assert experts and all(shape[0] == 2 for shape in experts.values())  # 8 experts / 4 ranks
        assert bias == [0.0, 0.0]  # the routers' selection bias starts at zero, not at uninitialised memory
        for name, p in reference.named_parameters():
            assert torch.equal(torch.from_numpy(full[name]), p), name
    assert sum(local for local, *_ in results) == total


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


def test_qwen2_moe_head2_ctx2_matches_one_process_then_exports(moe_dirs, spawned, tmp_path):
    init = [f"--model.init_from=hf:{moe_dirs['per_expert']}"]
    single = _train(init, tmp_path / "single")
    results, parallel_dir = spawned
    parallel = results["train"]
    assert len(single) == STEPS
    diff = max(abs(a - b) for losses in parallel for a, b in zip(losses, single))
    print(f"\nQwen2-MoE head 2 x ctx 2 against one process, {STEPS} steps: max |loss diff| = {diff:.2e}")
    assert diff <= 1e-4
    assert single[-1] < single[0]  # it trained
    recorded = load_config(parallel_dir / "config.toml").model
    assert (recorded.family, recorded.moe_experts, recorded.moe_layer_ids) == ("qwen2_moe", 8, (1, 2))

    out = tmp_path / "export"
    r = longctx_here("checkpoint", "export", str(parallel_dir / "checkpoints"), str(out), "--to", "hf")
    assert r.returncode == 0, r.stderr
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.models.hf import load_hf
    from longctx.models.llama import build_model

    trained = build_model(recorded, seed=None)
    load_model_weights(parallel_dir / "checkpoints" / f"step-{STEPS:08d}", trained)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen2MoeForCausalLM"
    t = torch.randint(0, 320, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (trained(t) - theirs(t).logits).abs().max().item()
        print(f"export of the trained Qwen2-MoE: max |logits diff| = {err:.2e}")
        assert err <= 1e-4
        start = load_hf(moe_dirs["per_expert"])
        assert (trained(t) - start(t)).abs().max().item() > 1e-3  # the export holds the trained weights
