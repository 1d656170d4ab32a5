"""`longctx generate` as a user runs it: on a Hugging Face directory (token-identical to transformers'
greedy generate, EOS included), on a checkpoint of a tiny longctx run, several prompts with seeded
sampling, stop strings; its bad input explained before any work; and `longctx bench generate`'s JSON."""

import json
import re
import sys
from pathlib import Path

import pytest
from test_newcomer import flat, longctx, longctx_here

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_hf  # noqa: E402
from test_tokenizer_follows_model import bpe_tokenizer  # noqa: E402

EOS = 0  # the BPE tokenizer's </s>


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A random Llama written by transformers, with a BPE tokenizer.json and eos_token_id in its config."""
    tmp = tmp_path_factory.mktemp("hf")
    d, ref = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=EOS))
    bpe_tokenizer(d / "tokenizer.json")
    return d, ref


def _run(*args, timeout=300):
    r = longctx("generate", *args, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r


def _run_here(*args):
    """_run in this process (test_newcomer.longctx_here): the tests of one process's decoding run
    many commands; _run keeps the real subprocess covered (greedy, a longctx checkpoint, --nproc 4,
    --compile)."""
    r = longctx_here("generate", *args)
    assert r.returncode == 0, r.stderr
    return r


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_greedy_matches_transformers_from_the_command_line(hf_model, tmp_path):
    d, ref = hf_model
    prompt = "def f(x):\n    return x + 1\nclass A:\n"
    out = tmp_path / "out.jsonl"
    r = _run("--checkpoint", f"hf:{d}", "--prompt", prompt, "--max-new-tokens", "64", "--output", str(out),
             "--prefill-chunk", "4")
    assert f"wrote {out}" in r.stderr
    [line] = _lines(out)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(prompt).ids
    assert line["prompt_tokens"] == len(ids)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=EOS,
                              pad_token_id=EOS)[0, len(ids):].tolist()
    if EOS in theirs:
        theirs = theirs[:theirs.index(EOS)]
        assert line["finish_reason"] == "eos"
    else:
        assert line["finish_reason"] == "length"
    assert line["tokens"] == theirs and len(theirs) > 0
    assert line["text"] == Tokenizer.from_file(str(d / "tokenizer.json")).decode(theirs)
    assert line["prefill_tokens_per_s"] > 0 and line["decode_tokens_per_s"] >= 0


def test_several_prompts_seeded_sampling_and_stop(hf_model, tmp_path):
    d, _ = hf_model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [{"prompt": "import os", "id": "a"}, {"prompt": "class A:"},
                                                         {"prompt": "def f(x):\n    return x", "id": 3}]) + "\n")
    sample = ["--checkpoint", f"hf:{d}", "--prompts", str(prompts), "--max-new-tokens", "16", "--temperature", "1.0",
              "--top-p", "0.9", "--top-k", "40", "--seed", "5", "--batch", "2"]
    _run_here(*sample, "--output", str(tmp_path / "a.jsonl"))
    _run_here(*sample, "--output", str(tmp_path / "b.jsonl"))
    a, b = _lines(tmp_path / "a.jsonl"), _lines(tmp_path / "b.jsonl")
    assert a == [{**x, **{k: y[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}} for x, y in zip(b, a)]
    assert [x.get("id") for x in a] == ["a", None, 3] and all(x["tokens"] for x in a)
    # without --output the lines go to stdout; a stop string cuts the text before it
    greedy = _run_here("--checkpoint", f"hf:{d}", "--prompt", "import os", "--max-new-tokens", "24")
    [line] = [json.loads(x) for x in greedy.stdout.splitlines()]
    text = line["text"]
    stop = re.search(r"[!-~]{2}", text).group()  # two printable ASCII characters of the greedy text
    cut = _run_here("--checkpoint", f"hf:{d}", "--prompt", "import os", "--max-new-tokens", "24", "--stop", stop)
    [c] = [json.loads(x) for x in cut.stdout.splitlines()]
    assert c["finish_reason"] == "stop" and c["text"] == text[:text.index(stop)]
    assert c["tokens"] == line["tokens"][:len(c["tokens"])] and len(c["tokens"]) < len(line["tokens"])


def test_generation_config_seeds_samples_and_logprobs(hf_model, tmp_path):
    """generation_config.json's sampling defaults (said once on stderr); a prompt's "seed" field and the
    run's seed x its index decide its tokens whatever --batch and whatever else is in the file;
    --num-samples 2 writes two lines per prompt (sample 0, 1); --logprobs 3 the chosen token's and the
    top 3 per position."""
    import shutil

    from longctx.generate.sampling import derive_seed

    d, _ = hf_model
    shutil.copytree(d, tmp_path / "hf")
    d = tmp_path / "hf"
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.9, "top_k": 30,
                                                          "repetition_penalty": 1.1, "max_new_tokens": 12,
                                                          "eos_token_id": EOS}))
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": "import os", "seed": 5}, {"prompt": "class A:\n    def"}, {"prompt": "x = [1, 2"}]
    prompts.write_text("\n".join(json.dumps(p) for p in rows) + "\n")
    base = ["--checkpoint", f"hf:{d}", "--prompts", str(prompts), "--seed", "3"]
    r = _run_here(*base, "--num-samples", "2", "--logprobs", "3", "--output", str(tmp_path / "a.jsonl"))
    assert r.stderr.count("defaults from generation_config.json: do_sample true, temperature 0.9, top_k 30, "
                          "repetition_penalty 1.1, max_new_tokens 12") == 1
    a = _lines(tmp_path / "a.jsonl")
    assert [x["sample"] for x in a] == [0, 1] * 3
    assert [x["seed"] for x in a[::2]] == [5, derive_seed(3, 1), derive_seed(3, 2)]
    for x in a:
        assert 0 < len(x["tokens"]) <= 12 and len(x["logprobs"]) == len(x["tokens"]) == len(x["top_logprobs"])
        assert all(len(top) == 3 and top[0][1] >= top[-1][1] for top in x["top_logprobs"])
        assert all(lp <= 0 for lp in x["logprobs"])
    # the same requests at --batch 1, and prompt 1 alone first in its file (its own seed: the same tokens)
    _run_here(*base, "--batch", "1", "--output", str(tmp_path / "b.jsonl"))
    assert [x["tokens"] for x in _lines(tmp_path / "b.jsonl")] == [x["tokens"] for x in a[::2]]
    prompts.write_text(json.dumps(rows[0]) + "\n")
    _run_here(*base, "--output", str(tmp_path / "c.jsonl"))
    assert _lines(tmp_path / "c.jsonl")[0]["tokens"] == a[0]["tokens"]
    # --ignore-eos: every line runs to its limit (generation_config's 12), EOS kept as a token
    _run_here(*base, "--ignore-eos", "--temperature", "0", "--output", str(tmp_path / "d.jsonl"))
    assert [(x["finish_reason"], len(x["tokens"]), "seed" in x) for x in _lines(tmp_path / "d.jsonl")] == \
        [("length", 12, False)]


def test_checkpoint_of_a_longctx_run(tmp_path):
    run = tmp_path / "run"
    r = longctx_here("train", "--nproc", "1", "--train.seq_len=64", "--data.max_docs=30", "--train.eval_interval=0",
                     "--model.layers=1", "--train.steps=2", "--train.global_batch=1", "--checkpoint.interval=2",
                     "--metrics.plots=false", "--metrics.progress=false", f"--train.run_dir={run}")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out.jsonl"
    _run("--checkpoint", str(run / "checkpoints"), "--prompt", "def main():", "--max-new-tokens", "12",
         "--output", str(out))
    [line] = _lines(out)
    assert line["prompt_tokens"] == len("def main():")  # byte tokenizer (the manifest's), no special tokens
    assert 0 < len(line["tokens"]) <= 12 or line["finish_reason"] == "eos"
    # the run trained on 64 positions and its checkpoint says so: a longer prompt is refused, whatever
    # max_seq_len says (config/positions.py)
    [step] = (run / "checkpoints").glob("step-*")
    assert json.loads((step / "manifest.json").read_text())["trained_positions"] == 64
    r = longctx_here("generate", "--checkpoint", str(run / "checkpoints"), "--prompt", "x" * 80,
                     "--model.max_seq_len=4096")
    assert r.returncode == 2 and "past the 64 positions the model reaches" in flat(r.stderr)


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt (--prompt) is empty"),
    (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "x " * 300], "Use a shorter prompt; or extend it with RoPE scaling"),
])
def test_bad_input_is_one_paragraph_before_work(hf_model, args, message):
    d, _ = hf_model
    r = longctx_here("generate", "--checkpoint", f"hf:{d}", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert flat(r.stderr).startswith("longctx generate: error:") and message in flat(r.stderr)


def test_no_tokenizer_says_use_tokenizer(tmp_path):
    d, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("qwen2"))
    r = longctx_here("generate", "--checkpoint", f"hf:{d}", "--prompt", "hello")
    assert r.returncode == 2 and "has no tokenizer.json" in flat(r.stderr) and "--tokenizer" in flat(r.stderr)


def test_bench_generate_prints_json():
    # (in this process: a new interpreter buys nothing here; its sharded ranks are spawned either way)
    r = longctx_here("bench", "generate", "--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                     "--ffn-dim", "128", "--vocab", "512", "--prompt-len", "64", "--new-tokens", "8", "--repeats", "1",
                     "--memory-lengths", "256,512", "--prefill-chunk", "128", "--sharded", "1x2", "--sharded-lengths",
                     "256,512")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["same_tokens"] and result["decode_ratio"] > 0
    assert [m["prompt_tokens"] for m in result["prefill_memory"]] == [256, 512]
    sharded = result["sharded_memory"]
    assert [m["prompt_tokens"] for m in sharded] == [256, 512] and all(m["ranks_agree"] for m in sharded)
    assert all(0.5 <= m["cache_ratio"] <= 0.6 for m in sharded)  # half the slots per rank, plus the slack


@pytest.mark.slow
def test_sharded_over_head_and_ctx_ranks_gives_one_process_tokens(hf_model, tmp_path):
    """`--nproc 4` (head 2 x ctx 2 by default): the cache sharded, the same lines as one process,
    written once (rank 0); a prompt of any length (none here is a multiple of 2 x head x ctx = 8)."""
    d, _ = hf_model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["import os\nimport sys\n" * 9, "class A:", "def f(x):\n    return x"]) + "\n")
    common = ["--checkpoint", f"hf:{d}", "--prompts", str(prompts), "--max-new-tokens", "32"]
    _run_here(*common, "--output", str(tmp_path / "one.jsonl"))
    r = _run(*common, "--nproc", "4", "--output", str(tmp_path / "four.jsonl"))
    assert "4 ranks (head 2 x ctx 2, the cache sharded)" in r.stderr and r.stderr.count("wrote") == 1
    one, four = _lines(tmp_path / "one.jsonl"), _lines(tmp_path / "four.jsonl")
    assert [x["tokens"] for x in four] == [x["tokens"] for x in one] and all(x["tokens"] for x in one)
    assert [x["text"] for x in four] == [x["text"] for x in one]


@pytest.mark.parametrize("args, message", [
    (["--nproc", "3", "--parallel.head", "2"], "--nproc 3 must equal --parallel.head x --parallel.ctx = 2 x 1"),
    (["--nproc", "2", "--parallel.dp_shard", "2"], "parallel.dp_shard does not apply"),
    (["--nproc", "3", "--parallel.head", "3"], "model.heads (4) must be divisible by parallel.head (3)"),
])
def test_bad_layouts_are_refused_before_work(hf_model, args, message):
    d, _ = hf_model
    r = longctx_here("generate", "--checkpoint", f"hf:{d}", "--prompt", "x", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and message in flat(r.stderr), r.stderr


@pytest.fixture(scope="module")
def draft_dirs(hf_model, tmp_path_factory):
    """Drafts for the hf_model target: a 1-layer model of its tokenizer, and two it must refuse."""
    tmp = tmp_path_factory.mktemp("drafts")
    d, _ = hf_model
    small, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", eos_token_id=EOS, num_hidden_layers=1),
                                     name="small")
    (small / "tokenizer.json").write_text((d / "tokenizer.json").read_text())
    vocab, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", vocab_size=320), name="vocab")
    other, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama", num_hidden_layers=1), name="other")
    bpe_tokenizer(other / "tokenizer.json", vocab_size=280)
    return {"small": small, "vocab": vocab, "other": other}


def test_speculative_decoding_gives_the_plain_greedy_lines(hf_model, draft_dirs, tmp_path):
    """--draft (a 1-layer model, then the target itself as its own draft): the same tokens and text as
    plain greedy decoding, with tau per line (the target as draft keeps every proposal: tau = K + 1);
    with penalties and --logprobs, plain decoding's tokens and log-probabilities with them."""
    d, _ = hf_model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["import os\nimport sys\n", "class A:"]) + "\n")
    common = ["--checkpoint", f"hf:{d}", "--prompts", str(prompts), "--max-new-tokens", "24"]
    _run_here(*common, "--output", str(tmp_path / "plain.jsonl"))
    plain = _lines(tmp_path / "plain.jsonl")
    for draft, k, cape in ((draft_dirs["small"], 3, []), (d, 4, []), (draft_dirs["small"], 3, ["--cape"]),
                           (draft_dirs["small"], 3, ["--speculate-adaptive"]),
                           (draft_dirs["small"], 3, ["--cape", "--speculate-adaptive", "--draft-cost", "0.2"])):
        out = tmp_path / f"spec-{k}-{'-'.join(cape)}.jsonl"
        r = _run_here(*common, "--draft", f"hf:{draft}", "--speculate", str(k), *cape, "--output", str(out))
        assert "speculative decoding with" in r.stderr
        assert ("each round's chosen from those kept so far" in r.stderr) == ("--speculate-adaptive" in cape)
        spec = _lines(out)
        assert [x["tokens"] for x in spec] == [x["tokens"] for x in plain] and all(x["tokens"] for x in plain)
        assert [x["text"] for x in spec] == [x["text"] for x in plain]
        assert all(x["target_passes"] >= 1 and 1 <= x["tau"] <= k + 1 for x in spec)
        if draft == d:  # its own draft: every proposal kept (the last pass may stop early at the limit)
            assert all(x["tau"] > k for x in spec if x["finish_reason"] == "length")
    # with a penalty and --logprobs: plain decoding's tokens and log-probabilities
    extra = ["--repetition-penalty", "1.3", "--frequency-penalty", "0.2", "--logprobs", "2"]
    _run_here(*common, *extra, "--output", str(tmp_path / "plain-pen.jsonl"))
    _run_here(*common, *extra, "--draft", f"hf:{draft_dirs['small']}", "--output", str(tmp_path / "spec-pen.jsonl"))
    plain, spec = _lines(tmp_path / "plain-pen.jsonl"), _lines(tmp_path / "spec-pen.jsonl")
    assert [x["tokens"] for x in spec] == [x["tokens"] for x in plain] != [x["tokens"] for x in _lines(
        tmp_path / "plain.jsonl")]
    for a, b in zip(spec, plain):
        assert len(a["logprobs"]) == len(a["tokens"]) and len(a["top_logprobs"][0]) == 2
        assert max(abs(u - v) for u, v in zip(a["logprobs"], b["logprobs"])) <= 1e-4


@pytest.mark.parametrize("draft, extra, message", [
    ("small", ["--speculate", "0"], "--speculate must be >= 1"),
    ("small", ["--speculate", "0", "--speculate-adaptive"], "--speculate is the most tokens --speculate-adaptive"),
    ("vocab", [], "has a vocabulary of 320 tokens but the target"),
    ("other", [], "a draft must share the target's tokenizer"),
    ("small", ["--cape", "--cape-table", "0.5:2,0.9:1"], "does not cover the confidences [0, 1]"),
    ("small", ["--cape", "--temperature", "0.7"], "--cape verifies its tree greedily"),
])
def test_a_draft_that_cannot_draft_is_refused_before_work(hf_model, draft_dirs, draft, extra, message):
    d, _ = hf_model
    r = longctx_here("generate", "--checkpoint", f"hf:{d}", "--prompt", "x", "--draft", f"hf:{draft_dirs[draft]}",
                     *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr and message in flat(r.stderr), r.stderr


def test_bench_decode_prints_its_figures(hf_model, draft_dirs, tmp_path):
    """`longctx bench decode`: spans of a text file at two lengths, the chain, CaPE, and both in one
    process against the same plain runs; the keys the issue names, and identical output at T = 0."""
    d, _ = hf_model
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 60)
    for cape, samples in (([], 1), (["--cape", "true"], 1), (["--cape", "both", "--repeats", "2"], 3),
                          (["--speculate-adaptive", "both"], 1)):
        # (3: more documents than the text, which is one, holds)
        # (in this process: the glide test below runs `bench decode` as a subprocess)
        r = longctx_here("bench", "decode", "--target", f"hf:{d}", "--draft", f"hf:{draft_dirs['small']}", "--data",
                         str(text), "--lengths", "32,96", "--samples", str(samples), "--max-new-tokens", "16",
                         "--speculate", "3", *cape)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        for key in ("tau", "tau_without_bonus", "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s", "speedup",
                    "identical"):
            assert key in out, key
        assert out["identical"] and 1 <= out["tau"] <= 4 and 0 <= out["acceptance_rate"] <= 1
        assert out["tau"] == pytest.approx(out["tau_without_bonus"] + 1)
        assert out["device"].startswith("cpu") and out["dtype"] == "fp32"  # (--device auto on a CPU machine)
        for g in out["by_length"]:  # each prompt's figures, which the length's sum
            assert len(g["per_prompt"]) == g["prompts"] and all(p["identical"] for p in g["per_prompt"])
            taus = [p["tau"] for p in g["per_prompt"]]
            assert min(taus) - 1e-9 <= g["tau"] <= max(taus) + 1e-9  # (the length's tau pools its prompts' passes)
        assert [g["prompt_tokens"] for g in out["by_length"]] == [32, 96] and out["cape"] == (
            "0.3:3,0.6:2,0.9:1,1:0" if "true" in cape else None)  # (with both, the top level is the chain's)
        both = out.get("with_cape")
        assert (both is not None) == ("--cape" in cape and "both" in cape)
        assert out["mean_k"] == 3 and out["speculate_adaptive"] is False  # (fixed K: --speculate every pass)
        adaptive = out.get("with_adaptive")
        assert (adaptive is not None) == ("--speculate-adaptive" in cape)
        if adaptive is not None:  # adaptive K beside the fixed one, against the very same plain runs
            # (mean K below 1 where plain steps, K = 0, were chosen: plain_step_share says how many)
            assert adaptive["identical"] and 0 <= adaptive["mean_k"] <= 3 and adaptive["draft_cost"] > 0
            assert 0 <= adaptive["plain_step_share"] <= 1 and adaptive["verify_cost"] == 0
            assert adaptive["mean_k"] > 0 or adaptive["plain_step_share"] > 0
            assert adaptive["baseline_tokens_per_s"] == out["baseline_tokens_per_s"]
            assert [g["prompt_tokens"] for g in adaptive["by_length"]] == [32, 96]
            assert all("mean_k" in p for g in adaptive["by_length"] for p in g["per_prompt"])
            assert "96 adaptive: tau" in r.stderr
        if both is not None:  # CaPE's figures beside the chain's, against the very same plain runs
            assert both["identical"] and 1 <= both["tau"] <= 4 and [g["prompt_tokens"] for g in both["by_length"]] == [
                32, 96]
            assert both["baseline_tokens_per_s"] == out["baseline_tokens_per_s"]
            assert both["cape"] == "0.3:3,0.6:2,0.9:1,1:0"
            assert "96 CaPE: tau" in r.stderr and "96: tau" in r.stderr
        # a shortfall of prompts is said, not left to read as noise
        short = re.findall(r"holds (\d+) documents of (\d+) tokens or more, not the (\d+) asked", r.stderr)
        held = out["by_length"][1]["prompts"]
        assert short == ([] if samples == 1 else [(str(held), "96", str(samples))])
        assert out["by_length"][0]["prompts"] == held == 1  # (one prompt per length and document)


@pytest.fixture(scope="module")
def glide_dirs(tmp_path_factory):
    """A tiny longctx target (2 layers) and a GliDe draft trained against it on our stack, both by
    `longctx train` (in this process: the tests read the checkpoints, not how the runs' processes end)."""
    tmp = tmp_path_factory.mktemp("glide")
    common = ["--nproc", "1", "--train.seq_len=128", "--data.max_docs=30", "--train.eval_interval=0",
              "--train.global_batch=2", "--metrics.plots=false", "--metrics.progress=false"]
    r = longctx_here("train", *common, "--model.layers=2", "--train.steps=6", "--checkpoint.interval=6",
                     f"--train.run_dir={tmp / 'target'}")
    assert r.returncode == 0, r.stderr
    r = longctx_here("train", "--config", "configs/glide.toml", *common, "--train.steps=6", "--checkpoint.interval=6",
                     f"--draft.target={tmp / 'target' / 'checkpoints'}", "--draft.block=3",
                     f"--train.run_dir={tmp / 'glide'}")
    assert r.returncode == 0, r.stderr
    return tmp / "target" / "checkpoints", tmp / "glide" / "checkpoints"


def test_a_glide_draft_decodes_what_plain_greedy_decodes(glide_dirs, tmp_path):
    """--draft DIR of a GliDe draft (it reads the target's cache): the same tokens as plain greedy
    decoding, as a chain and with CaPE; `bench decode` takes it too."""
    target, glide = glide_dirs
    common = ["--checkpoint", str(target), "--prompt", "def main():\n    return", "--max-new-tokens", "20"]
    _run_here(*common, "--output", str(tmp_path / "plain.jsonl"))
    [plain] = _lines(tmp_path / "plain.jsonl")
    for cape in ([], ["--cape"]):
        out = tmp_path / f"glide{len(cape)}.jsonl"
        r = _run_here(*common, "--draft", str(glide), "--speculate", "3", *cape, "--output", str(out))
        assert "GliDe draft (block 3, " in r.stderr  # (its parameters beside the block)
        [line] = _lines(out)
        assert line["tokens"] == plain["tokens"] and 1 <= line["tau"] <= 4
    r = longctx("bench", "decode", "--target", str(target), "--draft", str(glide), "--lengths", "64",
                "--samples", "1", "--max-new-tokens", "12", "--speculate", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["identical"]


def test_a_glide_draft_of_another_target_is_refused_before_work(hf_model, glide_dirs):
    d, _ = hf_model
    _, glide = glide_dirs
    r = longctx_here("generate", "--checkpoint", f"hf:{d}", "--prompt", "x", "--draft", str(glide))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is a GliDe draft trained against" in flat(r.stderr), r.stderr


def test_a_glide_draft_of_a_same_shape_target_is_refused_by_identity(glide_dirs, tmp_path):
    """Issue 53: a target of the very same shape (another seed) is another target: refused before work,
    naming both; the draft's own target, reached through its step directory, is accepted."""
    target, glide = glide_dirs
    other = tmp_path / "other"
    r = longctx_here("train", "--nproc", "1", "--train.seq_len=128", "--data.max_docs=30", "--train.eval_interval=0",
                     "--train.global_batch=2", "--metrics.plots=false", "--metrics.progress=false", "--model.layers=2",
                     "--train.steps=2", "--checkpoint.interval=2", "--train.seed=7", f"--train.run_dir={other}")
    assert r.returncode == 0, r.stderr
    r = longctx_here("generate", "--checkpoint", str(other / "checkpoints"), "--prompt", "x", "--draft", str(glide))
    said = flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "is a GliDe draft trained against" in said and "holds other weights" in said and "same shape" in said
    [step] = target.glob("step-*")
    _run_here("--checkpoint", str(step), "--prompt", "x", "--max-new-tokens", "4", "--draft", str(glide))


@pytest.mark.slow
def test_compile_gives_the_same_lines(hf_model, draft_dirs, tmp_path):
    """--compile (the compiled static-shape decode step): the same tokens as eager decoding, plain
    (two prompts in one batch) and speculative with a 1-layer draft. The eager lines run in this process
    (_run_here: a new interpreter buys nothing there); the compiled ones in a real subprocess."""
    d, _ = hf_model
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["import os\nimport sys\n", "class A:"]) + "\n")
    common = ["--checkpoint", f"hf:{d}", "--prompts", str(prompts), "--max-new-tokens", "16"]
    for extra in (["--batch", "2"], ["--draft", f"hf:{draft_dirs['small']}", "--speculate", "3"]):
        _run_here(*common, *extra, "--output", str(tmp_path / "eager.jsonl"))
        # (compiling took over 300 s of a loaded 2-core machine: a timeout, not a difference)
        r = _run(*common, *extra, "--compile", "--output", str(tmp_path / "compiled.jsonl"), timeout=900)
        assert "ran compiled in the warm-up" in r.stderr
        eager, compiled = _lines(tmp_path / "eager.jsonl"), _lines(tmp_path / "compiled.jsonl")
        assert [x["tokens"] for x in compiled] == [x["tokens"] for x in eager] and all(x["tokens"] for x in eager)
