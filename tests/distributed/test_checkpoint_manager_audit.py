"""Checkpoint manager audit (checkpoint/manager.py, manifest.py): what a checkpoint holds is exactly the
training state of its step, whatever the layout that wrote it and whatever happens after the save starts.

- Resharding: a 2-rank FSDP2 job's AdamW states (weights, both moments, step counts, a persistent buffer
  such as the aux-free router bias) load into one process bit for bit equal to the saving job's own
  full tensors (gathered there with full_tensor, not read back through the manager).
- co2: the replicas' weights and moments differ between merges. DCP keeps one copy of each replicated
  tensor, and by default the copy of whichever rank has written least so far: a mix of replicas (some
  weights from replica 0, others from replica 1, their moments from yet another choice) that no rank
  ever held, loaded as the model by a resume under sync or another layout. The checkpoint must hold one
  replica's whole state (replica 0's: its own local-rank files say what it was).
- Async saves: an in-place update made by the next optimizer step while the save is in flight never
  reaches the files.
- Identity: a resume into a model whose q/k norm spans another width (model.qk_norm_span) is refused by
  the manifest's model check with a clear error, not by a size-mismatch trace from inside DCP; so are
  another vocabulary and tied embeddings over an untied checkpoint (which DCP alone would load without
  its head). And whatever the model check knows, a checkpoint holding model tensors the model lacks is
  refused: DCP reads only the keys it is asked for, so it would load part of it without a word.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from longctx.checkpoint.manager import CheckpointManager
from longctx.config import load_config
from longctx.config.checkpoint_paths import CheckpointError
from longctx.config.load import to_dict
from longctx.job.spawn import run_spawned

pytestmark = pytest.mark.usefixtures("one_thread")


def _quiet(*_a, **_k):
    pass


def _manager(root, rank=0, world=1, async_save=False, model_cfg=None):
    return CheckpointManager(Path(root), keep=3, async_save=async_save, rank=rank, world=world,
                             layout={"world": world}, model_cfg=model_cfg or {}, log=_quiet)


class _Tiny(torch.nn.Module):
    """Uneven shapes (5 rows over 2 ranks: FSDP2 pads a shard) and a persistent buffer updated in place
    like the aux-free router bias."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3, bias=False)
        self.register_buffer("bias_like", torch.zeros(3), persistent=True)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.bias_like


def _train_tiny(model, optimizer, steps, shard=0):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + shard)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model.bias_like += 0.25 * (step + 1)  # the same on every rank, as the router bias is


def _full(t):
    """The whole tensor as a numpy array (sent back by value: a tensor would travel as shared memory that
    the rank's exit can take away first)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy().copy()


def _save_sharded(root):
    """2 ranks, FSDP2 over both: 3 AdamW steps, save; returns the job's full states gathered here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    _train_tiny(model, optimizer, 3, dist.get_rank())
    manager = _manager(root, dist.get_rank(), 2)
    manager.save(3, model, optimizer, {"cursor": 12})
    manager.wait()
    names = dict(model.named_parameters())
    return {"params": {n: _full(p) for n, p in names.items()}, "bias_like": _full(model.bias_like),
            "state": {n: {k: _full(v) for k, v in optimizer.state[p].items()} for n, p in names.items()}}


def test_fsdp_states_reshard_into_one_process_exactly(tmp_path):
    saved = run_spawned(2, _save_sharded, str(tmp_path))[0]
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    manager = _manager(tmp_path)
    path, manifest = manager.resume_point("auto")
    assert manager.load(path, model, optimizer, manifest)["sampler"] == {"cursor": 12}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.from_numpy(saved["params"][name])), name
        state = optimizer.state[p]
        assert set(state) == set(saved["state"][name]) == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in saved["state"][name].items():
            assert torch.equal(state[k], torch.from_numpy(v)), (name, k)
    assert float(optimizer.state[model.a.weight]["step"]) == 3.0
    assert torch.equal(model.bias_like, torch.from_numpy(saved["bias_like"])) and model.bias_like.tolist() == [1.5] * 3


# ---------------------------------------------------------------------------------------------
# co2: one replica's whole state, not a mix

CO2 = ["--train.eval_interval=0", "--metrics.plots=false", "--metrics.progress=false", "--data.max_docs=300",
       "--train.seq_len=128", "--train.warmup_steps=2", "--parallel.dp_replicate=2", "--model.layers=1",
       "--train.data_parallel=co2", "--train.co2_local_steps=4", "--train.steps=4", "--checkpoint.interval=3",
       "--checkpoint.final=false"]  # saved at step 3: inside the first round, the replicas apart


def _co2_run(run_dir):
    from longctx.train.trainer import train

    train(load_config("configs/debug.toml", [*CO2, f"--train.run_dir={run_dir}"]), log=_quiet)


def test_a_co2_checkpoint_holds_one_replicas_whole_state(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from longctx.models.llama import build_model

    run_spawned(2, _co2_run, str(tmp_path))
    ck = tmp_path / "checkpoints" / "step-00000003"
    dcp_to_torch_save(ck, tmp_path / "full.pt")  # DCP's own reader: what any resume loads
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    # each replica's own state, as its rank kept it (train/co2.py: weights flat, moments per parameter)
    local = [torch.load(ck / f"local-rank{r}.pt", weights_only=True)["co2"] for r in range(2)]
    names = [n for n, _ in build_model(load_config("configs/debug.toml", CO2).model, device="meta").named_parameters()]
    sizes = [full["model"][n].numel() for n in names]
    assert local[0]["weights"].numel() == sum(sizes)  # (dp_shard 1: a replica's local weights are whole)
    weights = [w.split(sizes) for w in (local[0]["weights"], local[1]["weights"])]
    mixed = []
    for i, name in enumerate(names):
        assert not torch.equal(weights[0][i], weights[1][i]), f"{name}: the replicas should differ at step 3"
        saved = {"weight": full["model"][name].reshape(-1).float(),
                 **{k: full["optim"]["state"][name][k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")}}
        mine = {"weight": weights[0][i], **{k: local[0]["optimizer"][i][k].reshape(-1) for k in ("exp_avg",
                                                                                                  "exp_avg_sq")}}
        mixed += [f"{name} {k}" for k in saved if not torch.equal(saved[k], mine[k])]
    assert not mixed, f"not replica 0's (of {3 * len(names)}): {mixed}"


# ---------------------------------------------------------------------------------------------
# async: the save holds its own step

def test_an_async_save_holds_its_steps_states_not_the_next_update(tmp_path):
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    _train_tiny(model, optimizer, 2)
    expected = {n: t.clone() for n, t in model.state_dict().items()}
    moments = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()}
    manager = _manager(tmp_path, async_save=True)
    manager.save(2, model, optimizer, {"cursor": 8})
    _train_tiny(model, optimizer, 1)  # the loop goes on while the save is written: in place, every tensor
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    manager.wait()
    fresh = _Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    loader = _manager(tmp_path)
    path, manifest = loader.resume_point("auto")
    assert loader.load(path, fresh, fresh_opt, manifest)["step"] == 2
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, expected[name]), name
    for name, p in fresh.named_parameters():
        for k, v in moments[name].items():
            assert torch.equal(fresh_opt.state[p][k], v), (name, k)


# ---------------------------------------------------------------------------------------------
# identity: another q/k norm width is refused before loading

def test_a_changed_qk_norm_span_is_refused_before_loading(tmp_path):
    from longctx.models.llama import build_model

    # Qwen3-MoE and OLMoE of one shape but for the q/k norms' width (each head's vector vs the whole projection)
    args = ["--model.preset=debug-moe", "--model.layers=2", "--model.qk_norm=true"]
    saved_cfg = load_config(None, [*args, "--model.family=qwen3_moe", "--model.qk_norm_span=head"])
    model = build_model(saved_cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    _manager(tmp_path, model_cfg=to_dict(saved_cfg)["model"]).save(1, model, optimizer, {})
    other_cfg = load_config(None, [*args, "--model.family=olmoe", "--model.qk_norm_span=all"])
    other = build_model(other_cfg.model)
    before = {n: t.clone() for n, t in other.state_dict().items()}
    manager = _manager(tmp_path, model_cfg=to_dict(other_cfg)["model"])
    path, manifest = manager.resume_point("auto")
    with pytest.raises(CheckpointError, match="qk_norm_span head in the checkpoint vs all configured"):
        manager.load(path, other, torch.optim.AdamW(other.parameters()), manifest)
    assert all(torch.equal(t, before[n]) for n, t in other.state_dict().items())  # nothing was loaded


@pytest.mark.parametrize("saved_args, resumed_args, said", [
    # untied -> tied: the tied model has no output.weight, so DCP alone would load the rest and drop the head
    (["--model.tie_embeddings=false"], ["--model.tie_embeddings=true"],
     "tie_embeddings False in the checkpoint vs True configured"),
    (["--model.vocab_size=320"], ["--model.vocab_size=384"], "vocab_size 320 in the checkpoint vs 384 configured"),
])
def test_another_embedding_shape_is_refused_before_loading(tmp_path, saved_args, resumed_args, said):
    from longctx.models.llama import build_model

    small = ["--model.layers=1", "--model.dim=32", "--model.heads=2", "--model.kv_heads=1", "--model.ffn_dim=64"]
    saved_cfg = load_config(None, [*small, *saved_args])
    model = build_model(saved_cfg.model)
    _manager(tmp_path, model_cfg=to_dict(saved_cfg)["model"]).save(1, model, torch.optim.AdamW(model.parameters()), {})
    other_cfg = load_config(None, [*small, *resumed_args])
    other = build_model(other_cfg.model, seed=1)
    before = {n: t.clone() for n, t in other.state_dict().items()}
    manager = _manager(tmp_path, model_cfg=to_dict(other_cfg)["model"])
    path, manifest = manager.resume_point("auto")
    with pytest.raises(CheckpointError, match=said):
        manager.load(path, other, torch.optim.AdamW(other.parameters()), manifest)
    assert all(torch.equal(t, before[n]) for n, t in other.state_dict().items())


def test_a_checkpoint_of_a_larger_model_is_refused_not_partly_loaded(tmp_path):
    # no model config to compare (model_cfg {}: the check of its fields passes): the tensors themselves must fit
    torch.manual_seed(0)
    big = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    _manager(tmp_path).save(1, big, torch.optim.AdamW(big.parameters()), {})
    small = torch.nn.Sequential(torch.nn.Linear(3, 4))
    before = small[0].weight.detach().clone()
    manager = _manager(tmp_path)
    path, manifest = manager.resume_point("auto")
    with pytest.raises(CheckpointError, match=r"model tensors that the configured model lacks \(1.bias, 1.weight\)"):
        manager.load(path, small, torch.optim.AdamW(small.parameters()), manifest)
    assert torch.equal(small[0].weight, before)  # nothing was loaded
