"""InfLLM's context memory at its seams: sharded over 2 ctx ranks against one process, through eval's
--mode generate, and the library backends' own checks of the memory's shape.

- Two ctx ranks (generate/sharded_infllm.py) give one process's tokens, finish reasons and
  log-probabilities (1e-5) at the edges: a prompt one short of the first unit and one at it, prompts
  that are no multiple of the block or of the ranks' shares, a top-k above the units' count, a block
  of 1 and a block as long as the window, prefill chunks that are no divisor of anything, two prompts
  of one length choosing their own units, a prompt's samples at T > 0 ended at different steps.
- `longctx eval --mode generate --context-memory infllm` answers through the memory: every sample's
  text is that of the library's generate() through InfLLMGeneration on the same prompt (and not plain
  generation's, so the memory was used), on one process and under --nproc 2, and the JSON records the
  memory's every size.
- The backends refuse a shape the command would refuse (before: the library ran `repr` 0, whose units
  all scored 0, so top-k took the first units by index whatever the query, and `topk` 0, which
  retrieved nothing; the command's checks were the only ones).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longctx.models.context_memory import InfLLMShape

pytestmark = pytest.mark.usefixtures("one_thread")

# (shape, prompt length, new tokens, prefill chunk, samples, temperature)
CASES = [
    (InfLLMShape(block=16, repr=3, topk=2, window=32, init=4), 35, 16, 4096, 1, 0.0),  # the first unit at 52
    (InfLLMShape(block=16, repr=3, topk=2, window=32, init=4), 52, 16, 4096, 1, 0.0),  # a unit whole at the prompt
    (InfLLMShape(block=16, repr=16, topk=1, window=32, init=0), 133, 20, 5, 1, 0.0),
    (InfLLMShape(block=5, repr=1, topk=3, window=10, init=7), 121, 20, 3, 1, 0.0),
    (InfLLMShape(block=3, repr=2, topk=100, window=9, init=1), 70, 12, 4096, 2, 1.0),  # every unit chosen
    (InfLLMShape(block=8, repr=2, topk=3, window=16, init=3), 99, 16, 4096, 3, 0.7),
    (InfLLMShape(block=1, repr=1, topk=5, window=2, init=2), 40, 8, 4096, 1, 0.0),
    (InfLLMShape(block=64, repr=4, topk=1, window=64, init=0), 200, 8, 4096, 1, 0.0),  # a rank empty for a while
]


def _model():
    from longctx.config import ModelConfig
    from longctx.models.llama import build_model

    cfg = ModelConfig(dim=64, layers=2, heads=4, kv_heads=2, ffn_dim=128, vocab_size=97, init_std=0.2)
    return build_model(cfg, seed=5).eval()


def _prompt(n, seed):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stop(row, tokens):  # rows of one call end at different steps (a stop string's verdict, by count here)
    return len(tokens) >= 3 + 4 * row


def _generate_cases(ctx: int):
    """Each CASES entry's [(tokens, log-probabilities, finish reason)] per row: two prompts of one length
    (their samples after), generated through the one-process memory (ctx 1) or over ctx ranks."""
    from longctx.generate.context_memory import InfLLMGeneration
    from longctx.generate.engine import generate
    from longctx.generate.sampling import Sampling

    torch.set_num_threads(1)
    model, mesh = _model(), None
    if ctx > 1:
        from longctx.config import load_config
        from longctx.job.runtime import Runtime

        mesh = Runtime.create(load_config(overrides=[f"--parallel.ctx={ctx}"]), torch.distributed.get_rank(), ctx,
                              "cpu").mesh
    out = []
    for i, (shape, n, new, chunk, samples, t) in enumerate(CASES):
        if ctx > 1:
            from longctx.generate.sharded_infllm import ShardedInfLLMGeneration

            backend = ShardedInfLLMGeneration(shape, mesh)
        else:
            backend = InfLLMGeneration(shape)
        results = generate(model, [_prompt(n, i), _prompt(n, 100 + i)], max_new_tokens=new, prefill_chunk=chunk,
                           num_samples=samples, logprobs=0, backend=backend,
                           sampling=Sampling(temperature=t, seed=3) if t else Sampling(),
                           stop=_stop if samples > 1 else None)
        out.append([(r.tokens, r.logprobs, r.finish_reason) for r in results])
    return out


@pytest.mark.slow
def test_two_ctx_ranks_answer_as_one_process_at_the_seams():
    from longctx.job.spawn import run_spawned_many

    one = _generate_cases(1)
    assert any(len({reason for *_, reason in rows}) > 1 or len({len(t) for t, *_ in rows}) > 1 for rows in one)
    ranks = run_spawned_many(2, [("cases", _generate_cases, (2,))], timeout=600)["cases"]
    for rank, got in enumerate(ranks):
        for case, (want_rows, got_rows) in enumerate(zip(one, got)):
            assert len(got_rows) == len(want_rows)
            for (tokens, lps, reason), (t2, lp2, r2) in zip(want_rows, got_rows):
                assert (t2, r2) == (tokens, reason), (rank, case)
                torch.testing.assert_close(torch.tensor(lp2), torch.tensor(lps), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# eval --mode generate through the memory

SHAPE = {"block": 16, "repr": 3, "topk": 2, "window": 32, "init": 4, "positions": "ordered"}
EVAL = ["--task", "passkey", "--lengths", "160,232", "--depths", "0,0.5", "--samples", "1", "--mode", "generate"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random Llama written by transformers, a BPE tokenizer.json, and a filler text."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    import test_hf
    from test_tokenizer_follows_model import bpe_tokenizer

    tmp = tmp_path_factory.mktemp("infllm-eval")
    d, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=0))
    bpe_tokenizer(d / "tokenizer.json")
    words = "the grass is green and the sky is blue so we go home again today".split()
    gen = torch.Generator().manual_seed(1)
    (tmp / "filler.txt").write_text(" ".join(words[i] for i in torch.randint(0, len(words), (6000,), generator=gen)))
    return d, tmp / "filler.txt"


def _memory_flags():
    return ["--context-memory", "infllm", *sum(([f"--infllm-{k}", str(v)] for k, v in SHAPE.items()), [])]


def _eval_args(d, filler, *extra):
    from longctx.cli import build_parser

    return build_parser("eval").parse_known_args(["eval", "--checkpoint", f"hf:{d}", "--data", str(filler), *EVAL,
                                                  *extra])


def _library_answers(request, backend_of):
    """Each sequence's answer text as the library's generate() gives it through `backend_of()` (None: plain),
    on eval's own prompts (the special prefix, then the sequence up to its answer)."""
    from longctx.config.tokenizer import model_text_prefix
    from longctx.data.tokenizer import load_tokenizer
    from longctx.eval.defaults import EXTRA_NEW_TOKENS
    from longctx.eval.generate_mode import answer_start, answer_text
    from longctx.generate.engine import generate
    from longctx.generate.loading import eos_ids, load_model

    tokenizer = load_tokenizer(request.tokenizer)
    prefix = model_text_prefix(request.cfg.model.init_from, tokenizer)
    model = load_model(request.cfg, torch.device("cpu"), torch.float32)
    eos = eos_ids(request.cfg.model.init_from, tokenizer)
    texts = {}
    for length in request.lengths:
        for q in request.sequences[length]:
            cut = answer_start(q)
            backend = backend_of()
            r = generate(model, [list(prefix) + q.tokens[:cut].tolist()], max_new_tokens=q.length - cut +
                         EXTRA_NEW_TOKENS, eos_ids=eos, **({} if backend is None else {"backend": backend}))[0]
            texts.setdefault(length, []).append(answer_text(tokenizer, r.tokens))
    return texts


@pytest.mark.slow
def test_eval_generate_mode_answers_through_the_memory(hf_dir, tmp_path):
    from longctx.eval.generate_mode import TEXT_CHARS, evaluate_generate
    from longctx.eval.request import prepare
    from longctx.generate.context_memory import InfLLMGeneration

    d, filler = hf_dir
    args, rest = _eval_args(d, filler, *_memory_flags())
    request = prepare(args, rest, 1)
    one = evaluate_generate(request, args)
    assert one["context_memory"] == {"method": "infllm", **SHAPE}
    shape = InfLLMShape(**SHAPE)
    memory = _library_answers(request, lambda: InfLLMGeneration(shape))
    plain = _library_answers(request, lambda: None)
    got = {length: [t for r in one["results"] if r["length"] == length for t in r["generated"]]
           for length in request.lengths}
    want = {length: [t[:TEXT_CHARS] for t in texts] for length, texts in memory.items()}
    assert got == want
    assert got != {length: [t[:TEXT_CHARS] for t in texts] for length, texts in plain.items()}  # the memory was used
    out = tmp_path / "two.json"
    argv = ["eval", "--checkpoint", f"hf:{d}", "--data", str(filler), *EVAL, *_memory_flags(), "--nproc", "2"]
    r = subprocess.run([sys.executable, "-m", "longctx", *argv, "--output", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    two = json.loads(out.read_text())
    assert two["layout"]["ctx"] == 2 and two["context_memory"] == one["context_memory"]
    assert [x["generated"] for x in two["results"]] == [x["generated"] for x in one["results"]]


# ------------------------------------------------------------------------------------------------
# the backends' own checks

BAD = [
    ({"repr": 0}, "--infllm-repr must be >= 1"),
    ({"topk": 0}, "--infllm-topk must be >= 1"),
    ({"window": 12}, "does not divide --infllm-window 12"),
    ({"block": 0}, "--infllm-block must be >= 1"),
    ({"init": -1}, "--infllm-init must be >= 0"),
    ({"repr": 9}, "more than the 8 tokens of a unit"),
]


@pytest.mark.parametrize("over, said", BAD)
def test_the_backends_refuse_a_shape_the_command_refuses(over, said):
    from longctx.generate.context_memory import InfLLMGeneration
    from longctx.generate.sharded_infllm import ShardedInfLLMGeneration

    shape = InfLLMShape(**{**{"block": 8, "repr": 2, "topk": 2, "window": 16, "init": 4}, **over})
    with pytest.raises(ValueError, match=said):
        InfLLMGeneration(shape)
    with pytest.raises(ValueError, match=said):
        ShardedInfLLMGeneration(shape, None)  # (refused before the mesh is read)
