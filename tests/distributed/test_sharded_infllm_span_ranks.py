"""The sharded InfLLM cache's local span and far part (generate/sharded_infllm.py _Layer._span: held slots
by one kernel call, the call's own by a masked softmax, merged by the log-sum-exp; _far: rows of different
counts run by run, unmasked) inside real ranks of ctx 2 (gloo): every layer's partial (out, lse) on every
rank equals the replaced paths (one fp32 softmax over all the rank's slots with the full mask,
tests/unit/test_sharded_infllm_span_split.py's references) to 1e-6, through a prompt's prefill chunks (the
span from position 0, then after the memory units), greedy decoding (batch 1) and two samples (batch 2,
rows choosing different units). InfLLM is sharded over ctx only (head 1), so no head x ctx layout."""

import pytest
import torch

from longctx.job.spawn import run_spawned

LENGTH, NEW = 200, 6


def _rank(ctx: int) -> dict:
    import sys

    import numpy as np

    from longctx.config import load_config
    from longctx.generate import sharded_infllm
    from longctx.generate.engine import generate
    from longctx.generate.sampling import Sampling
    from longctx.job.runtime import Runtime
    from longctx.models.context_memory import InfLLMShape, rotate
    from longctx.models.llama import build_model

    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/unit")
    from test_sharded_infllm_span_split import _old_far_tail, _old_span

    shape = InfLLMShape(block=16, repr=2, topk=3, window=64, init=8)
    rt = Runtime.create(load_config(overrides=[f"--parallel.ctx={ctx}"]), torch.distributed.get_rank(), ctx, "cpu")
    model = build_model(load_config(overrides=["--model.layers=2"]).model, seed=3).eval()
    backend = sharded_infllm.ShardedInfLLMGeneration(shape, rt.mesh)
    worst, seen, chosen = [0.0], set(), []
    span, far, top = sharded_infllm._Layer._span, sharded_infllm._Layer._far, sharded_infllm.top_units

    def diff(got, want):
        return max((got[0].float() - want[0]).abs().max().item(),
                   (torch.nan_to_num(got[1], neginf=0.0) - torch.nan_to_num(want[1], neginf=0.0)).abs().max().item())

    def checked_span(self, q, lo, end):
        got = span(self, q, lo, end)
        worst[0] = max(worst[0], diff(got, _old_span(self, q, lo, end, self.cache.step.positions)))
        seen.add(("span", q.shape[1] > 1, lo > 0, q.shape[0]))
        return got

    def checked_far(self, q, query_pos, units, init):
        got = far(self, q, query_pos, units, init)
        c = self.cache
        slots = [np.concatenate([np.arange(s.start, s.stop, dtype=np.int64) for s in [c.slots(0, init)] + [
            c.slots(init + u * shape.block, init + (u + 1) * shape.block) for u in row]])
            for row in chosen[-1].tolist()]
        if max(len(x) for x in slots):
            want = _old_far_tail(self, rotate(q, shape.far - query_pos, c.inv_freq), slots)
            worst[0] = max(worst[0], diff(got, want))
            seen.add(("far", len({len(x) for x in slots}) > 1, q.shape[0]))
        return got

    def recorded_top(scores, k):
        chosen.append(top(scores, k))
        return chosen[-1]

    sharded_infllm._Layer._span, sharded_infllm._Layer._far = checked_span, checked_far
    sharded_infllm.top_units = recorded_top
    prompt = torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        generate(model, [prompt], max_new_tokens=NEW, backend=backend)
        generate(model, [prompt], max_new_tokens=NEW, backend=backend, num_samples=2,
                 sampling=Sampling(temperature=1.0, seed=11))
    return {"worst": worst[0], "seen": sorted(seen, key=str)}


@pytest.mark.slow
def test_span_and_far_equal_the_replaced_paths_on_every_rank():
    for found in run_spawned(2, _rank, 2):
        assert found["worst"] < 1e-6, found
        seen = {tuple(s) for s in found["seen"]}
        for case in [("span", True, False, 1), ("span", True, True, 1), ("span", False, True, 1),
                     ("span", False, True, 2), ("far", False, 1), ("far", False, 2), ("far", True, 2)]:
            assert case in seen, (case, seen)
