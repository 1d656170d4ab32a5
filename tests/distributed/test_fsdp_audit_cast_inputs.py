"""train.loss_weighting = sequence under FSDP's bf16 gathers (the GPU policy: parallel/fsdp/shard.py
mixed_precision, forced here on CPU): each label's weight 1 / N_k (data/sequence_weights.py, fp32) reaches
the loss as the batch holds it. FSDP2 casts a module's floating-point forward inputs to its param_dtype
(MixedPrecisionPolicy.cast_forward_inputs); on the root that cast only ever meets the label weights (tokens,
positions, document ids and labels are integers), and it rounded each 1 / N_k to bf16: a sequence's weights
summed to 1 +- 0.4% instead of 1 (2 ranks, a row of 6 documents each: up to 2.0e-3 off, 4.5e-8 now), so
each sequence counted a little more or less than once, on GPU under FSDP only (one GPU without FSDP keeps them fp32)."""

import pytest

from fsdp_audit import config
from longctx.job.spawn import run_spawned

pytestmark = pytest.mark.slow


def _weights_reaching_the_model(raw):
    import torch

    import longctx.parallel.fsdp.shard as shard
    from longctx.data.sequence_weights import weigh_sequences
    from longctx.planner.validate_ranks import micro_batches, setup_case
    from longctx.step.loss import forward_loss_sum

    shard.gathers_in_bf16 = lambda device_type, dtype: True  # the GPU's policy (this spawned rank only)
    cfg, rt, model, opt, batch, scale = setup_case(raw)
    local = micro_batches(cfg, rt, batch)[0]  # (dp_shard 2: this rank's rows whole)
    weights, _ = weigh_sequences((local.labels != -100).numpy(), local.doc_ids.numpy())
    local.label_weights = torch.from_numpy(weights)
    seen = {}

    def record(module, args, kwargs):  # runs after FSDP's own pre-forward hook (prepended): what forward gets
        seen["w"] = kwargs["label_weights"].clone()

    model.register_forward_pre_hook(record, with_kwargs=True)
    forward_loss_sum(model, local, None).backward()
    return local.label_weights, seen["w"], local.doc_ids, local.labels


def test_sequence_weights_reach_the_loss_unrounded_under_bf16_gathers():
    got = run_spawned(2, _weights_reaching_the_model, config(train__dtype="bf16", train__global_batch=2,
                                                             train__loss_weighting="sequence"))
    for given, reached, doc_ids, labels in got:
        sums = [reached[r][(doc_ids[r] == d) & (labels[r] != -100)].double().sum().item()
                for r in range(doc_ids.shape[0]) for d in doc_ids[r].unique().tolist()]
        worst = max(abs(s - 1) for s in sums)
        print(f"reached as {reached.dtype}: a sequence's weights sum to 1 within {worst:.1e}")
        assert reached.dtype == given.dtype == __import__("torch").float32
        assert reached.equal(given)
        assert worst < 1e-5
