"""Plain decoding through the compiled step in blocks (generate/blocks.py): the host reads the tokens once
per block, not once per token, and the tokens are the eager path's exactly.
- host reads per decode token (Tensor.tolist / item / bool / int / float counted): under 1/4 greedy and
  sampled (one per token greedy, three sampled, before the blocks);
- eager ops outside the compiled step per decode token: a few (copies), not the LM head and the choice;
- tokens, finish reasons, logprobs and each row's streamed tokens as eager: greedy, seeded sampling with
  several samples, EOS and a stop inside a block, ragged limits, penalties and min_new_tokens;
- 64 tokens compile one graph (a counting backend; fullgraph: no graph break) and another generation of
  other lengths compiles nothing;
- a row whose distribution is not finite is an error at the block's read (its UNCHOSEN token fed on
  as a valid id meanwhile);
- a block's uniforms are the row's stream of one draw per step."""

import collections

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import longctx.models.static_decode as static_decode
from longctx.config import load_config
from longctx.generate.blocks import BLOCK, block_uniforms
from longctx.generate.engine import generate
from longctx.generate.sampling import NonFiniteLogits, Sampling
from longctx.models.llama import build_model
from longctx.models.static_decode import CompiledStep

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # compilations of earlier tests neither count nor use up the recompile limit
    yield
    torch._dynamo.reset()


def _model(seed=1, **over):
    """The debug model with 2 layers, not its 4: what is checked is outside the layers or the same in each
    (a block traces 16 steps of every layer: dynamo's time grows with them)."""
    over = {"layers": 2, **over}
    overrides = ["--model.preset=debug"] + [f"--model.{k}={v}" for k, v in over.items()]
    return build_model(load_config(overrides=overrides).model, seed=seed).eval()


def _prompt(n, seed=0):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Counted(CompiledStep):
    """A step compiled with a counting backend (the captured graph run as is)."""

    def __init__(self):
        self.counter = CompileCounter()
        super().__init__(backend=self.counter)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _host_reads_and_ops(monkeypatch, model, prompt, new, sampling, step):
    """(host reads, eager ops outside the compiled step) of one generation of `new` tokens."""
    reads = collections.Counter()

    def counting(name):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, **k):
            reads[name] += 1
            return real(self, *a, **k)
        return counted

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    real_launch = CompiledStep.launch

    def launch(self, *args, **kwargs):  # the compiled step's own work is not counted
        with _disable_current_modes():
            return real_launch(self, *args, **kwargs)

    monkeypatch.setattr(CompiledStep, "launch", launch)
    ops = Ops()
    with ops:
        generate(model, [prompt], max_new_tokens=new, sampling=sampling, compile=step)
    monkeypatch.undo()
    return sum(reads.values()), ops.count


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_k=40, seed=3)],
                         ids=["greedy", "sampled"])
def test_host_reads_per_decode_token_are_under_a_quarter(monkeypatch, sampling):
    """Measured over the decode steps (a 65-token generation less a 1-token one: the prefill's share out).
    Before the blocks: 1 read per token greedy (the loop's tolist), 3 sampled (+ the finiteness check's
    bool and the host uniform's float), and 27 / 38 eager ops per token outside the compiled step."""
    model, prompt = _model(), _prompt(40)
    step = Counted()
    generate(model, [prompt], max_new_tokens=3, sampling=sampling, compile=step)  # compiled before counting
    reads_1, ops_1 = _host_reads_and_ops(monkeypatch, model, prompt, 1, sampling, step)
    reads_65, ops_65 = _host_reads_and_ops(monkeypatch, model, prompt, 65, sampling, step)
    per_token_reads, per_token_ops = (reads_65 - reads_1) / 64, (ops_65 - ops_1) / 64
    assert per_token_reads <= 2 / BLOCK < 1 / 4, per_token_reads  # (the tolist, and the block's uniforms)
    assert per_token_ops < 8, per_token_ops  # (a step's positions, the token's copy, views)


def test_64_tokens_compile_one_graph_without_breaks():
    model = _model()
    step = Counted()
    counters.clear()
    tokens = generate(model, [_prompt(30, seed=2)], max_new_tokens=65, compile=step)[0].tokens
    assert len(tokens) == 65 and step.calls == 64  # every decode step went through the compiled step
    assert step.counter.frame_count == 1  # one graph for 64 positions: none per token, none per block size
    assert not counters["graph_break"]
    generate(model, [_prompt(51, seed=3)], max_new_tokens=37, compile=step)  # another cache length
    assert step.counter.frame_count == 1


def _same(model, prompts, **kwargs):
    """The eager and the blocked compiled generation of the same request: their results, and each row's
    streamed tokens."""
    streams = {}
    results = {}
    for name, compile in (("eager", False), ("compiled", Counted())):
        seen = collections.defaultdict(list)
        results[name] = generate(model, prompts, on_token=lambda row, token, seen=seen: seen[row].append(token),
                                 compile=compile, **kwargs)
        streams[name] = dict(seen)
    for eager, compiled in zip(results["eager"], results["compiled"]):
        assert compiled.tokens == eager.tokens
        assert compiled.finish_reason == eager.finish_reason
        if eager.logprobs is not None:
            torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs))
    assert streams["compiled"] == streams["eager"]
    return results["eager"]


def test_greedy_with_eos_and_stop_inside_a_block_is_eager_token_for_token():
    model = _model()
    prompts = [_prompt(40, seed=1), _prompt(7, seed=2), _prompt(23, seed=3)]
    plain = generate(model, prompts, max_new_tokens=40)
    eos = plain[1].tokens[20]  # row 1 ends on it in its second block (or earlier, where it came before)

    def stop(row, tokens):  # row 2 stops after its sixth token, inside the first block
        return row == 2 and len(tokens) >= 6

    results = _same(model, prompts, max_new_tokens=[40, 40, 33], eos_ids=[eos], stop=stop, logprobs=2)
    assert results[1].finish_reason == "eos" and results[2].finish_reason == "stop"


def test_seeded_sampling_with_samples_and_logprobs_is_eager_token_for_token():
    model = _model(seed=2)
    s = Sampling(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, seed=5)
    _same(model, [_prompt(12, seed=4), _prompt(30, seed=5)], max_new_tokens=[21, 35], sampling=s, num_samples=2,
          logprobs=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_penalties_and_min_new_tokens_follow_every_token_of_a_block(temperature):
    model = _model(seed=3)
    plain = generate(model, [_prompt(20, seed=6)], max_new_tokens=30)[0].tokens
    s = Sampling(temperature=temperature, seed=1, repetition_penalty=1.3, frequency_penalty=0.5,
                 presence_penalty=0.2, min_new_tokens=18)
    _same(model, [_prompt(20, seed=6), _prompt(9, seed=7)], max_new_tokens=30, sampling=s, eos_ids=[plain[3]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_that_turns_non_finite_inside_a_block_is_an_error_not_a_token(monkeypatch, temperature):
    """The decode steps' distribution is NaN (the prefill's is not): the compiled choice gives UNCHOSEN,
    fed to the block's next steps as a valid id (-1 failed the embedding's lookup), and the block's read
    raises NonFiniteLogits."""
    model = _model(layers=1)
    real = static_decode.static_hidden_states

    def nan_hidden(*args):
        return real(*args) * float("nan")

    monkeypatch.setattr("longctx.generate.blocks.static_hidden_states", nan_hidden)
    with pytest.raises(NonFiniteLogits, match="sampled distribution" if temperature else "greedy choice"):
        generate(model, [[1, 2, 3]], max_new_tokens=20, sampling=Sampling(temperature=temperature),
                 compile=Counted())


def test_a_blocks_uniforms_are_the_stream_of_one_draw_per_step():
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    block = block_uniforms(generators, 16, "cpu")
    again = [torch.Generator().manual_seed(s) for s in (3, 4)]
    one_by_one = torch.tensor([[float(torch.rand((), dtype=torch.float64, generator=g)) for g in again]
                               for _ in range(16)], dtype=torch.float64)
    assert block.shape == (16, 2) and torch.equal(block, one_by_one)
