"""A block of plain decode steps captured once and replayed (generate/blocks.py BlockGraph), held on CPU
against what a CUDA graph's capture requires of it:
- the captured steps take nothing from the host: no host read or sync (host_sync.py's probe) and no tensor
  made from host data (torch.tensor, as_tensor, from_numpy: a graph would replay the value it was
  captured with) -- every block's own inputs reach the steps through the static buffers, copied in before;
- the first block of a size on a cache runs its steps as they are (compiling, warming up), the second is
  captured and replayed, every later one replayed only: one capture per cache, size and sampling;
- replayed blocks give the eager path's tokens, greedy and seeded sampling alike, over several blocks and
  generations (a graph holds its cache's addresses: a later generation replays it on the cache kept for its
  shape, generate/cache_pool.py; test_decode_cache_reuse.py holds that).
On CPU a capture does not exist (capture_for is None: the steps run each time); here a stand-in records the
steps under the checks above, and its replay runs them again."""

from unittest import mock

import pytest
import torch
from test_decode_blocks import Counted
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import longctx.generate.blocks as blocks
from host_sync import no_host_sync
from longctx.config import load_config
from longctx.generate.blocks import BLOCK
from longctx.generate.engine import generate
from longctx.generate.sampling import Sampling
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class NoHostData(TorchDispatchMode):
    """Refuses a tensor made from host data (torch.tensor, as_tensor, from_numpy: each lifts its host values
    into a tensor, aten.lift_fresh, under a mode), which a captured graph would freeze at its capture's value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            raise AssertionError("a tensor made from host data inside the captured steps")
        return func(*args, **(kwargs or {}))


class StandIn:
    """A capture that runs the steps once under the checks (as a capture records them), and whose replay
    runs them again."""

    captures = 0

    def __init__(self, steps):
        StandIn.captures += 1
        real = CompiledStep.launch

        def launch(step, *args, **kwargs):  # (the compiled step itself: one graph, fullgraph, no host read in it)
            with _disable_current_modes():
                return real(step, *args, **kwargs)

        with mock.patch.object(CompiledStep, "launch", launch), no_host_sync(), NoHostData():
            steps()
        self.steps, self.replays = steps, 0

    def replay(self):
        self.replays += 1
        fast = self.steps.__self__.cache.fast
        calls = fast.calls
        self.steps()
        fast.calls = calls  # (a graph's replay runs no Python: the block counts its steps itself)


@pytest.fixture
def stand_in(monkeypatch):
    StandIn.captures = 0
    monkeypatch.setattr(blocks, "capture_for", lambda device: StandIn)
    return StandIn


def _model():
    cfg = load_config(overrides=["--model.preset=debug", "--model.layers=2"]).model
    return build_model(cfg, seed=1).eval()


def _prompt(n, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9, top_k=50, seed=5)],
                         ids=["greedy", "sampled"])
def test_replayed_blocks_are_the_eager_tokens_and_capture_once_per_cache(stand_in, sampling):
    model, step = _model(), Counted()
    new = 4 * BLOCK + 5  # four full blocks (one run, one capture, two replays) and a partial one
    eager = generate(model, [_prompt(37)], max_new_tokens=new, sampling=sampling)[0].tokens
    got = generate(model, [_prompt(37)], max_new_tokens=new, sampling=sampling, compile=step)[0].tokens
    assert got == eager and len(got) == new
    assert stand_in.captures == 1  # (the full blocks' size; the partial block ran once, uncaptured)
    assert step.calls == new - 1  # every decode step counted, replayed ones too
    # another generation, on the kept cache: its full blocks replayed, its partial block's size (a second run
    # on the cache) captured; the same tokens
    again = generate(model, [_prompt(37)], max_new_tokens=new, sampling=sampling, compile=step)[0].tokens
    assert again == eager and stand_in.captures == 2


def test_rows_of_a_batch_and_their_ends_are_the_eager_ones(stand_in):
    """Two rows of other lengths and limits, one ending early: each row's tokens as eager."""
    model = _model()
    prompts, limits = [_prompt(20, 1), _prompt(33, 2)], [3 * BLOCK + 2, 2 * BLOCK - 3]
    eager = [r.tokens for r in generate(model, prompts, max_new_tokens=limits)]
    got = [r.tokens for r in generate(model, prompts, max_new_tokens=limits, compile=Counted())]
    assert got == eager and stand_in.captures == 1


def test_the_checks_refuse_what_a_graph_would_freeze(stand_in):
    """The stand-in's checks can fail: steps that take their positions from the host, as a step outside a
    block does (cache.begin's to_device), are refused at the capture."""
    with pytest.raises(AssertionError, match="host data"):
        StandIn(lambda: torch.from_numpy(__import__("numpy").arange(3)))


def test_no_capture_on_a_cpu_and_none_when_switched_off(monkeypatch):
    assert blocks.capture_for(torch.device("cpu")) is None
    monkeypatch.setenv("LONGCTX_DECODE_GRAPHS", "0")
    assert blocks.capture_for(torch.device("cuda")) is None
    monkeypatch.setenv("LONGCTX_DECODE_GRAPHS", "1")
    assert blocks.capture_for(torch.device("cuda")) is blocks._cuda_graph
