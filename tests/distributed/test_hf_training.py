"""Start from a Hugging Face checkpoint under a parallel layout: each rank materialises only its
shards, training matches one process step by step, and the export is what transformers reproduces.
The 4-rank training run and the 4-rank load share one spawned job (run_spawned_many)."""

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

STEPS = 10
BASE = [f"--train.steps={STEPS}", "--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false",
        "--data.max_docs=300", "--train.seq_len=256", "--train.lr=1e-3",
        "--data.tokenizer=byte"]  # (the random model has no tokenizer.json: its tokenizer is named)
QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=160,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=320,
             rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
             attention_bias=True, sliding_window=None, use_sliding_window=False, torch_dtype="float32",
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                              "original_max_position_embeddings": 128})


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A random tiny Qwen3 written by transformers, in three safetensors shards with an index."""
    d = tmp_path_factory.mktemp("qwen3")
    cfg = transformers.Qwen3Config(**QWEN3)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(d, max_shard_size="60KB")
    assert (d / "model.safetensors.index.json").is_file()
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return d


def _train(args, run_dir):
    cfg = load_config("configs/debug.toml", [*BASE, *args, f"--train.run_dir={run_dir}"])
    return train(cfg, log=lambda *a, **k: None).losses


PARALLEL = ["--parallel.head=2", "--parallel.ctx=2", "--checkpoint.interval=10"]


@pytest.fixture(scope="module")
def spawned(qwen3_dir, tmp_path_factory):
    """One 4-rank job: head 2 x ctx 2 training from the checkpoint (run directory `parallel`), then the
    dp_shard load of _sharded_load; ({key: per-rank results}, the training's run directory)."""
    run_dir = tmp_path_factory.mktemp("parallel")
    jobs = [("train", _train, ([f"--model.init_from=hf:{qwen3_dir}", *PARALLEL], str(run_dir))),
            ("load", _sharded_load, (str(qwen3_dir),))]
    return run_spawned_many(4, jobs), run_dir


def test_qwen3_head2_ctx2_matches_one_process_then_exports(qwen3_dir, spawned, tmp_path):
    init = [f"--model.init_from=hf:{qwen3_dir}"]
    single = _train(init, tmp_path / "single")
    results, parallel_dir = spawned
    parallel = results["train"]
    assert len(single) == STEPS
    for losses in parallel:
        diff = max(abs(a - b) for a, b in zip(losses, single))
        assert diff <= 1e-4, f"max |loss - single| = {diff:.2e}"
    assert single[-1] < single[0] - 0.2  # it trained
    # the run directory records the checkpoint's model, not the debug preset
    recorded = load_config(parallel_dir / "config.toml").model
    assert (recorded.family, recorded.dim, recorded.head_dim, recorded.rope_scaling) == ("qwen3", 64, 32, "yarn")

    out = tmp_path / "export"
    checkpoints = parallel_dir / "checkpoints"
    r = longctx_here("checkpoint", "export", str(checkpoints), str(out), "--to", "hf", "--max-shard-gb", "0.0001")
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors.index.json").is_file()
    # the run trained on the byte tokenizer, not the directory's (it has none, only a tokenizer_config.json): the
    # directory's files do not describe the ids, so none is copied beside the weights, as for a checkpoint chain
    assert not (out / "tokenizer_config.json").exists() and "no tokenizer files" in r.stdout, r.stdout
    from longctx.checkpoint.weights_only import load_model_weights
    from longctx.models.hf import load_hf
    from longctx.models.llama import build_model

    trained = build_model(recorded, seed=None)
    load_model_weights(parallel_dir / "checkpoints" / "step-00000010", trained)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    t = torch.randint(0, 320, (2, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (trained(t) - theirs(t).logits).abs().max().item() <= 1e-4
        start = load_hf(qwen3_dir)
        assert (trained(t) - start(t)).abs().max().item() > 1e-2  # the export holds the trained weights


def _sharded_load(path):
    """Build the training model of a 4-rank dp_shard layout; report this rank's materialised bytes
    and its weights gathered back to full tensors."""
    import torch.distributed as dist

    from longctx.job.runtime import Runtime
    from longctx.train.model import build_training_model

    cfg = load_config("configs/debug.toml", [*BASE, f"--model.init_from=hf:{path}"])
    rt = Runtime.create(cfg, dist.get_rank(), dist.get_world_size(), "cpu")
    model = build_training_model(cfg, torch.device("cpu"), rt, log=lambda *a: None)
    local = sum(p.to_local().numel() for p in model.parameters())
    # numpy, not tensors: torch's queue shares tensors through file descriptors that die with the rank
    full = {n: p.detach().full_tensor().numpy().copy() for n, p in model.named_parameters()}
    return local, full


def test_each_rank_materialises_only_its_shards(qwen3_dir, spawned):
    from longctx.models.hf import load_hf

    reference = load_hf(qwen3_dir)
    total = sum(p.numel() for p in reference.parameters())
    results = spawned[0]["load"]
    for local, full in results:
        assert local <= total / 4 + 2 * 64 * 4  # a quarter, give or take one row per tensor of uneven length
        for name, p in reference.named_parameters():
            assert torch.equal(torch.from_numpy(full[name]), p), name
    assert sum(local for local, _ in results) == total
