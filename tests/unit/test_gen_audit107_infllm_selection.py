"""InfLLM's core (models/context_memory.py) against an independent float64 reference of its documented
algorithm where the memory holds more units than it retrieves (test_infllm.py's reference retrieves them
all): per call and layer, each unit's representatives (per kv head, the `repr` keys the call that formed it
scores highest, turned back to position 0), the top-k units by the mean over the call's queries of
sum over heads q_far . rep (ties within the score grid to the earlier unit), and the attention over the
initial tokens, the chosen units (where --infllm-positions puts them) and the local span. Under both
placements, greedy and with a prompt's two samples (their rows copied after the prefill)."""

import math

import pytest
import torch

from longctx.config import ModelConfig
from longctx.generate.context_memory import InfLLMGeneration
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.context_memory import SCORE_GRID, InfLLMShape
from longctx.models.llama import build_model

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

CFG = ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab_size=97, init_std=0.2)


def _turn(x, pos, inv_freq):
    """x [..., d] (rotate-half pairs) turned by pos [...] x inv_freq, in float64."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    angle = pos.double()[..., None] * inv_freq.double()
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


class Reference:
    """The documented algorithm, call by call, beside the real core: the largest difference of outputs."""

    def __init__(self, shape: InfLLMShape, inv_freq: torch.Tensor):
        self.shape, self.inv_freq = shape, inv_freq
        self.reps: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, row, unit) -> [kv, d]
        self.prefilled: dict[int, int] = {}  # layer -> units formed by the prefill (one row)
        self.calls, self.error = 0, 0.0

    def check(self, q, layer, step, out) -> None:
        s, inv = self.shape, self.inv_freq
        b, n, h, d = q.shape
        keys, values = layer.k.double(), layer.v.double()  # [b, kv, L, d], keys turned at their slots
        kv = keys.shape[1]
        group = h // kv
        end = int(step.start[0]) + n
        init = min(s.init, end)
        units = max(0, (end - s.window - init) // s.block)
        if units == 0:
            return
        self.calls += 1
        lo = init + units * s.block
        for r in range(1, b):  # a prompt's samples: row 0's prefill units, copied
            for u in range(self.prefilled.get(layer.index, 0)):
                self.reps.setdefault((layer.index, r, u), self.reps[(layer.index, 0, u)])
        for r in range(b):
            for u in range(units):
                if (layer.index, r, u) in self.reps:
                    continue
                slots = torch.arange(s.init + u * s.block, s.init + (u + 1) * s.block)
                rep = torch.zeros(kv, d, dtype=torch.float64)
                for g in range(kv):
                    queries = q[r, :, g * group:(g + 1) * group].double().reshape(-1, d)
                    best = (keys[r, g, slots] @ queries.T).sum(1).topk(s.repr).indices
                    rep[g] = _turn(keys[r, g, slots[best]], -slots[best], inv).sum(0)
                self.reps[(layer.index, r, u)] = rep
        if b == 1:
            self.prefilled[layer.index] = units
        for r in range(b):
            positions = step.positions[r].double()
            q_far = _turn(q[r].double(), (s.far - positions)[:, None].expand(n, h), inv)
            score = torch.tensor([sum(float((q_far[:, x] @ self.reps[(layer.index, r, u)][x // group]).mean())
                                      for x in range(h)) for u in range(units)])
            grid = float(score.abs().max()) * SCORE_GRID
            snapped = [round(float(x) / grid) for x in score]
            chosen = sorted(sorted(range(units), key=lambda u: -snapped[u])[:s.topk])
            far = list(range(init)) + [s.init + u * s.block + o for u in chosen for o in range(s.block)]
            far_slots = torch.tensor(far, dtype=torch.float64)
            if s.positions == "shared":
                seen_at, q_at = torch.zeros_like(far_slots), torch.full((n,), float(s.far), dtype=torch.float64)
            else:
                place = {u: j for j, u in enumerate(chosen)}
                seen_at = torch.tensor([x if x < init else init + place[(x - s.init) // s.block] * s.block
                                        + (x - s.init) % s.block for x in far], dtype=torch.float64)
                q_at = positions - lo + init + len(chosen) * s.block
            for i in range(n):
                local = torch.arange(lo, int(positions[i]) + 1)
                for x in range(h):
                    g = x // group
                    far_keys = _turn(_turn(keys[r, g, far], -far_slots, inv), seen_at, inv)
                    query = _turn(_turn(q[r, i, x].double(), -positions[i], inv), q_at[i], inv)
                    logits = torch.cat([far_keys @ query, keys[r, g, local] @ q[r, i, x].double()])
                    weights = torch.softmax(logits / math.sqrt(d), 0)
                    expected = weights @ torch.cat([values[r, g, far], values[r, g, local]])
                    self.error = max(self.error, float((expected - out[r, i, x].double()).abs().max()))


def _checked_generation(shape: InfLLMShape, samples: int) -> Reference:
    model = build_model(CFG, seed=5).eval()
    prompt = torch.randint(0, CFG.vocab_size, (60,), generator=torch.Generator().manual_seed(60)).tolist()
    backend = InfLLMGeneration(shape)
    reference = Reference(shape, model.inv_freq.clone())
    make_cache = backend.cache

    def cache(model, batch, max_len, core=None):
        made = make_cache(model, batch, max_len, core)
        real = made.core

        def checked(q, k, v, layer, step):
            out = real(q, k, v, layer, step)
            reference.check(q, layer, step, out)
            return out
        made.core = checked  # (the views of its rows take it: KVCache.rows)
        return made

    backend.cache = cache
    sampling = Sampling(temperature=1.0) if samples > 1 else Sampling()
    generate(model, [prompt], max_new_tokens=8, prefill_chunk=8, backend=backend, sampling=sampling,
             num_samples=samples, seeds=[3])
    return reference


@pytest.mark.parametrize("samples", [1, 2])
@pytest.mark.parametrize("positions", ["shared", "ordered"])
def test_the_core_is_the_documented_algorithm_with_units_left_out(positions, samples):
    shape = InfLLMShape(block=4, repr=2, topk=2, window=16, init=4, positions=positions)
    reference = _checked_generation(shape, samples)
    assert reference.calls > 0  # (10 units form from the 60-token prompt; 2 are retrieved per call)
    assert reference.error < 1e-4, reference.error
