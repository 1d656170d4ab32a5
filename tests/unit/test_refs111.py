"""Failure modes of public projects (/work/shared/REFERENCES.md) that no other test could fail on.

- Ring merge in bf16: the ring's running (out, lse) must stay fp32 whatever the inputs, so the error of a
  bf16 ring against a float64 reference is the rounding of its bf16 partials and does not grow with the
  ring size. An accumulator kept in the inputs' dtype rounds once more per merge: its error grows with
  every block (measured rms / reference rounding, non-causal: 1.36, 1.36, 1.48, 1.82 at ctx 2, 3, 4, 8,
  where the fp32 accumulator gives 1.36, 1.15, 1.14, 1.07).
- Non-deterministic MoE combine (unsloth #1258, Megatron #6967): an index_add / scatter_add into float rows
  adds with atomics on CUDA, in an order the hardware picks. The one-device dispatch and combine (forward and
  backward, with and without drops) run no float scatter-add at all, so the same bits come out on every run,
  with torch's deterministic mode on or off. (CPU adds in a fixed order whatever the op: the ops are checked;
  tests/unit/test_moe_grouped_mm.py has the CUDA twin of the same-bits check.)
- Experts left uninitialised by a name mismatch on conversion (Megatron-Bridge #4706): every MoE family's
  checkpoint in both expert layouts (one tensor per expert, transformers 5's fused tensors), with one expert
  tensor removed or renamed, is refused naming it; none loads with that expert's weights left as initialised.
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longctx.config import load_config
from longctx.models.moe import MoEFeedForward
from longctx.ops.attention import attention
from longctx.parallel.context.ring import simulate_ring
from longctx.parallel.context.sequence import shard_indices

SEQ = 2 * 3 * 8 * 25  # 1200: a multiple of 2 x ctx for ctx 2, 3, 4 and 8


def _bf16_ring_errors(causal: bool) -> dict[int, float]:
    """{ctx: rms error of the bf16 ring's output / rms of rounding the float64 reference to bf16}.
    Near-uniform attention over values around 1 makes every block's weight count alike, so a rounding
    per merge adds up instead of hiding behind one dominant block."""
    gen = torch.Generator().manual_seed(0)
    q = (0.2 * torch.randn(1, SEQ, 2, 32, generator=gen, dtype=torch.float64)).bfloat16()
    k = torch.randn(1, SEQ, 2, 32, generator=gen, dtype=torch.float64).bfloat16()
    v = (1 + 0.3 * torch.randn(1, SEQ, 2, 32, generator=gen, dtype=torch.float64)).bfloat16()
    ref, _ = attention(q.double(), k.double(), v.double(), causal=causal, backend="math")
    rounding = (ref.bfloat16().double() - ref).pow(2).mean().sqrt().item()
    errors = {}
    for ctx in (2, 3, 4, 8):
        outs, lses = simulate_ring(q, k, v, ctx, causal=causal)
        assert outs[0].dtype == torch.bfloat16 and lses[0].dtype == torch.float32
        diff = torch.cat([(outs[r].double() - ref[:, shard_indices(SEQ, ctx, 1, r, 0)]).flatten() for r in range(ctx)])
        errors[ctx] = diff.pow(2).mean().sqrt().item() / rounding
    return errors


@pytest.mark.parametrize("causal", [True, False])
def test_bf16_ring_error_does_not_grow_with_the_ring_size(causal):
    errors = _bf16_ring_errors(causal)
    assert max(errors.values()) < 1.5, errors  # the rounding of the partials and of the result, no more
    for ctx in (3, 4, 8):
        assert errors[ctx] <= 1.03 * errors[2], errors


# ------------------------------------------------------------------------------------------------
# MoE combine: no float scatter-add, the same bits on every run

SCATTER_ADDS = ("index_add", "scatter_add", "scatter_reduce", "index_put", "_index_put_impl", "put")


class FloatScatterAdds(TorchDispatchMode):
    """The scatter-adds into floating-point tensors an autograd step runs where two sources share a
    destination (those add in no fixed order on CUDA). Integer counts are exact in any order and not listed,
    nor a scatter whose destinations are distinct (a gather's backward over a row's distinct top-k experts:
    each destination gets one value); index_put only with accumulate=True."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0].rstrip("_")
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in SCATTER_ADDS and target is not None and target.is_floating_point() and _collides(name, args,
                                                                                                     kwargs):
            self.seen.append(func.__name__)
        return func(*args, **kwargs)


def _collides(name: str, args, kwargs) -> bool:
    if name.startswith(("index_put", "_index_put", "put")):
        return bool(kwargs.get("accumulate", len(args) > 3 and args[3] is True))
    if name == "index_add":  # (self, dim, index, source): one destination row per index value
        return args[2].unique().numel() < args[2].numel()
    dim, index = args[1], args[2]  # scatter_add / scatter_reduce (self, dim, index, src)
    ordered = index.movedim(dim, -1).sort(-1).values
    return bool((ordered[..., 1:] == ordered[..., :-1]).any())


def _moe_layer(capacity_factor: float) -> MoEFeedForward:
    model = {"preset": "debug-moe", "dim": 32, "heads": 2, "kv_heads": 2, "moe.expert_dim": 16,
             "moe.top_k": 3, "moe.capacity_factor": capacity_factor}
    layer = MoEFeedForward(load_config(overrides={"model": model}).model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _moe_step(layer, x, mode=None):
    """(output, d input, d every parameter) of one forward + backward of the layer."""
    x = x.detach().clone().requires_grad_(True)
    with mode if mode is not None else contextlib.nullcontext():
        y = layer(x)
        got = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1])).sum(), (x, *layer.parameters()))
    return [y.detach(), *got]


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_moe_layer_runs_no_float_scatter_add_and_repeats_its_bits(capacity_factor):
    layer = _moe_layer(capacity_factor)
    x = torch.randn(96, 32, generator=torch.Generator().manual_seed(2))
    mode = FloatScatterAdds()
    first = _moe_step(layer, x, mode)
    assert not mode.seen, f"float scatter-adds (atomics on CUDA, no fixed order): {mode.seen}"
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        strict = [_moe_step(layer, x) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(before)
    for run in (*strict, _moe_step(layer, x)):
        assert all(torch.equal(a, b) for a, b in zip(first, run))


# ------------------------------------------------------------------------------------------------
# HF import: an expert tensor missing or renamed is refused in every family and layout

HF_FAMILIES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe-mlp_only", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"}


def _expert_tensor(names: list[str], layout: str) -> str:
    """One routed expert's tensor of the last MoE layer: expert 1's down projection (per expert) or the fused
    down_proj (fused), in whatever names the family's files use."""
    want = (".experts.1.w2.weight", ".experts.1.down_proj.weight") if layout == "per_expert" \
        else (".experts.down_proj",)
    found = [n for n in names if n.endswith(want)]
    assert found, (layout, names)
    return found[-1]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_hf_expert_tensor_missing_or_renamed_is_refused(tmp_path, family, layout):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file
    from test_hf_moe import hf_config, random_hf_dir

    from longctx.config.hf import HFFormatError
    from longctx.models.hf import load_hf

    d, _ = random_hf_dir(tmp_path, hf_config(HF_FAMILIES[family]), layout)
    file = d / "model.safetensors"
    assert file.is_file(), sorted(p.name for p in d.iterdir())  # (one file at this size)
    weights = load_file(file)
    name = _expert_tensor(sorted(weights), layout)
    load_hf(d)  # the files as written load
    renamed = name.replace(".weight", "_renamed.weight") if name.endswith(".weight") else f"{name}_renamed"
    for stored in ({n: t for n, t in weights.items() if n != name},                      # missing
                   {(renamed if n == name else n): t for n, t in weights.items()}):      # renamed
        save_file(stored, file, metadata={"format": "pt"})
        # (a fused tensor missing: the files are read as per expert, whose tensors of that layer are all missing)
        said = name if layout == "per_expert" else name.split(".experts.")[0] + ".experts."
        with pytest.raises(HFFormatError, match=rf"lacks {1 if layout == 'per_expert' else '[0-9]+'} tensors .*"
                                                rf"{said.replace('.', '[.]')}"):
            load_hf(d)
