"""Where FSDP gathers the blocks in bf16 (train.dtype auto / bf16 on a GPU with native bf16), each MoE
layer's router is gathered in fp32: one device routes from fp32 gate weights (models/moe.py Router.logits
selects in fp32), and the router inside a block's bf16 unit got them rounded to bf16, so 0.2-1.4% of
tokens went to another expert set than on one device. On CPU the gathers are fp32, so the test makes
FSDP gather bf16 as it does on a GPU (2 ranks, gloo) and checks, inside the sharded forward: the gate
weights the router reads are fp32 and equal the full model's, the rest of a block is bf16, and the
router's choices are the fp32 model's."""

import pytest

from longctx.job.spawn import run_spawned


def _route_under_bf16_gathers(router_kind: str):
    import torch

    from longctx.config import load_config
    from longctx.job.checks import check_layout
    from longctx.models.llama import build_model
    from longctx.models.moe import moe_layers
    from longctx.parallel.fsdp import shard

    cfg = load_config("configs/debug.toml", ["--model.preset=debug-moe", "--model.layers=2", "--model.dim=32",
                                             "--model.moe.experts=16", "--model.moe.top_k=4", "--train.seq_len=64",
                                             f"--model.moe.router={router_kind}",
                                             "--train.global_batch=2"])
    model = build_model(cfg.model, seed=3)
    gates = [layer.router.gate.weight.detach().clone() for layer in moe_layers(model)]
    shard.gathers_in_bf16 = lambda device_type, dtype: True  # as on a GPU (this rank's process only)
    shard.shard_model(model, check_layout(cfg, 2), cfg, "cpu")
    seen = []

    def record(router, args):  # (after FSDP's own pre-forward: the gate is gathered)
        block = next(b for b in model.layers if getattr(b.feed_forward, "router", None) is router)
        x = args[0].float()
        seen.append((router.gate.weight.dtype, block.attention.wq.weight.dtype,
                     torch.equal(router.gate.weight.detach(), gates[len(seen)]),
                     torch.equal(router.forward(x).experts, (x @ gates[len(seen)].t()).softmax(-1).topk(4).indices)
                     if router_kind == "softmax" else True))

    handles = [layer.router.register_forward_pre_hook(record) for layer in moe_layers(model)]
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    real = torch.ones(1, 64, dtype=torch.bool)
    real[:, 56:] = False  # a padding mask: the layer routes through router.logits as well as forward
    model(tokens, None, None, labels=tokens, real=real).backward()
    for h in handles:
        h.remove()
    grads = [layer.router.gate.weight.grad.dtype for layer in moe_layers(model)]
    return seen, grads, len(gates)


@pytest.mark.parametrize("router_kind", ["softmax", "sinkhorn"])
def test_routers_gather_fp32_where_the_blocks_gather_bf16(router_kind):
    """sinkhorn (and any padding mask) also calls router.logits directly: gathered as forward is (review)."""
    import torch

    for seen, grads, layers in run_spawned(2, _route_under_bf16_gathers, router_kind):
        assert len(seen) == layers > 0  # every MoE layer
        for gate_dtype, block_dtype, same_gate, same_choice in seen:
            assert (gate_dtype, block_dtype) == (torch.float32, torch.bfloat16)
            assert same_gate and same_choice
        assert grads == [torch.float32] * layers
