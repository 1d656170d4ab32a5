"""Small defects of `longctx generate`, `eval --mode generate` and `bench decode` (helper audit, tag gensmall).
Each test failed before its fix:

- --logprobs N above the model's vocabulary ran, each position's list silently cut to the vocabulary (300 of
  the 1000 asked); now one error before work.
- a --prompts file giving one "id" to two lines ran, its output lines carrying the same id for two prompts;
  now one error naming the id and its lines.
- bench decode skipped generate's vocabulary checks (a tokenizer with more ids than the target's vocabulary,
  a prompt id past it): it would fail in the embedding after both models had loaded. Now generate's own
  functions (generate/prompts.py check_tokenizer_vocab, check_prompt_ids) refuse it before.
- bench's older argument checks raised SystemExit (rc 1, a bare line) where every other command's bad input
  is a ConfigError (rc 2, "longctx COMMAND: error: ..."), as bench's own arg_checks.py were.
- a plain draft with a sliding window was refused at any length, with a message naming a model.max_seq_len
  the user never gave: drafts.py raised the draft's max_seq_len to the target's, which the window refuses.
  The draft now keeps its config; past its reach it is said (the output stays the target's: the target
  verifies each token, checked here against plain greedy decoding).
- eval --mode generate past a window without --context-memory infllm was refused naming model.max_seq_len
  (which eval sets from --lengths); now it names --lengths and the ways out.
"""

import json
import re
from types import SimpleNamespace

import pytest

from longctx.errors import ConfigError


def _llama_dir(path, vocab=300):
    """A Llama config.json and a stand-in safetensors file (generate's and bench decode's checks read no
    weights; a --draft's files are checked whole and readable, by their headers: generate/loading.py
    check_weight_files)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({"stand_in": torch.zeros(1)}, str(path / "model.safetensors"))
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _prepare(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--tokenizer",
                                                            "byte", "--max-new-tokens", "4", *argv])
    return prepare(args, rest)


def _said(e) -> str:
    return " ".join(str(e.value).split())


def test_logprobs_above_the_vocabulary_is_refused_before_work(tmp_path):
    d = _llama_dir(tmp_path / "hf")  # 300 tokens
    with pytest.raises(ConfigError) as e:
        _prepare(d, "--prompt", "hello", "--logprobs", "301")
    said = _said(e)
    assert "--logprobs 301" in said and "vocabulary has 300 tokens" in said and "--logprobs 300 or less" in said
    assert _prepare(d, "--prompt", "hello", "--logprobs", "300").limits == [4]  # (every token: no mistake)


def test_duplicate_prompt_ids_are_refused_naming_their_lines(tmp_path):
    from longctx.generate.prompts import read_prompts

    def read(lines):
        (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        return read_prompts(SimpleNamespace(prompt=None, prompts=str(tmp_path / "p.jsonl"), chat=False))

    with pytest.raises(ConfigError) as e:
        read([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
              {"id": 7, "prompt": "u"}, {"id": 7, "prompt": "v"}])
    said = _said(e)
    assert 'id "a" on lines 1, 3' in said and "id 7 on lines 4, 5" in said and "its own \"id\"" in said, said
    # ids told apart as a reader of the output tells them (1 and "1"), and lines without an id: taken
    assert [p.get("id") for p in read([{"id": 1, "prompt": "x"}, {"id": "1", "prompt": "y"}, {"prompt": "z"},
                                        {"prompt": "w"}])] == [1, "1", None, None]


def test_bench_decode_makes_generates_vocabulary_checks(tmp_path, monkeypatch):
    import longctx.generate.prompts as prompts_module
    from longctx.bench.decode import _models, _prompts
    from longctx.cli import build_parser
    from longctx.config import load_config
    from longctx.data.tokenizer import ByteTokenizer

    d = _llama_dir(tmp_path / "hf", vocab=200)  # fewer ids than the byte tokenizer's 258
    args, _ = build_parser("bench").parse_known_args(["bench", "decode", "--target", f"hf:{d}", "--draft", f"hf:{d}",
                                                      "--tokenizer", "byte"])
    # generate's refusal, through the function generate calls (not a copy of it)
    with pytest.raises(ConfigError, match=re.escape("the tokenizer byte has 258 tokens but the model's vocabulary "
                                                    "is 200")):
        _models(args)
    with pytest.raises(ConfigError, match="the tokenizer byte has 258 tokens"):
        _prepare(d, "--prompt", "hello")
    calls = []
    monkeypatch.setattr(prompts_module, "check_tokenizer_vocab", lambda *a: calls.append(a))
    _models(args)
    assert len(calls) == 1
    # a prompt's id past the vocabulary ("\u20ac" is bytes 226, 130, 172): said before any weight is read
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "price: \u20ac5"}) + "\n")
    m = load_config(None, {"model": {"init_from": f"hf:{d}"}, "train": {"seq_len": 2, "eval_interval": 0}}).model
    args = SimpleNamespace(prompts=str(tmp_path / "p.jsonl"), target=f"hf:{d}", max_new_tokens=4)
    with pytest.raises(ConfigError, match="prompt 1 has token id 226 but the model's vocabulary is 200"):
        _prompts(args, ByteTokenizer(), "byte", m)


@pytest.mark.parametrize("argv, said", [
    (("decode", "--target", "t", "--draft", "d", "--repeats", "0"), "--repeats 0: time at least one run"),
    (("attention", "--world", "4", "--head", "3", "--ctx", "1"), "--head 3 x --ctx 1 must equal --world 4"),
    (("train", "--steps", "1"), "--steps 1 leaves no timed step after the warm-up"),
    (("comm", "--cluster", "1x4"), "--cluster '1x4': at least 2 nodes"),
    (("moe", "--routing", "spiky"), "--routing spiky: one of uniform, skewed"),
])
def test_bench_bad_input_exits_as_every_commands_bad_input(capsys, argv, said):
    from longctx.cli import main

    # the rest of the CLI's convention, e.g. generate's: rc 2 and "longctx COMMAND: error: ..."
    assert main(["generate", "--checkpoint", "x", "--prompt", "a", "--max-new-tokens", "0"]) == 2
    assert "longctx generate: error: --max-new-tokens must be >= 1" in capsys.readouterr().err
    assert main(["bench", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"longctx bench {argv[0]}: error: {said}"), err  # (which benchmark, as before)


@pytest.fixture(scope="module")
def windowed_draft(tmp_path_factory):
    """(a random Llama target, a random 1-layer Mistral draft of its vocabulary with a 16-token window)."""
    pytest.importorskip("transformers")
    import test_hf

    tmp = tmp_path_factory.mktemp("gensmall_draft")
    target, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("llama"), name="target")
    draft, _ = test_hf.random_hf_dir(tmp, test_hf.hf_config("mistral", sliding_window=16, num_hidden_layers=1),
                                     name="draft")
    return target, draft


def _generate(target, prompt, *extra, out):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare, run

    argv = ["generate", "--checkpoint", f"hf:{target}", "--tokenizer", "byte", "--prompt", prompt,
            "--max-new-tokens", "20", "--output", str(out), *extra]
    args, rest = build_parser("generate").parse_known_args(argv)
    args.argv = argv[1:]
    request = prepare(args, rest)
    run(request, args)
    return request, json.loads(out.read_text())


def test_a_windowed_draft_decodes_losslessly_and_past_its_window_is_said(windowed_draft, tmp_path):
    target, draft = windowed_draft
    # within the draft's window (3 + 4 positions): was refused (its max_seq_len raised to the target's 256)
    request = _prepare(target, "--prompt", "abc", "--draft", f"hf:{draft}")
    assert request.draft_cfg.model.max_seq_len == 16 and not [n for n in request.notes if "the draft reaches" in n]
    # past it (a 39-token prompt + 20): the speculative tokens are plain greedy decoding's, and it is said
    prompt = "hello world, " * 3
    _, plain = _generate(target, prompt, out=tmp_path / "plain.jsonl")
    request, spec = _generate(target, prompt, "--draft", f"hf:{draft}", out=tmp_path / "spec.jsonl")
    assert spec["prompt_tokens"] == plain["prompt_tokens"] == 39 and len(plain["tokens"]) == 20
    assert spec["tokens"] == plain["tokens"]
    [note] = [" ".join(n.split()) for n in request.notes if "the draft reaches" in n]
    assert "take 59 positions, past the 16 the draft reaches" in note and "16-token sliding window" in note
    assert "The output is still the target's" in note


def test_eval_generate_past_the_window_names_the_lengths(tmp_path):
    pytest.importorskip("transformers")
    from test_swa_eval_audit import W, windowed_model

    from longctx.cli import build_parser
    from longctx.eval.request import prepare

    d, _, text = windowed_model(tmp_path)
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{d}", "--task", "passkey", "--mode", "generate", "--data", str(text),
         "--samples", "1", "--lengths", f"{W},{4 * W}"])
    with pytest.raises(ConfigError) as e:
        prepare(args, rest, 1)
    said = _said(e)
    assert said.startswith(f"--lengths {4 * W}: past the {W}-token sliding window"), said
    assert "max_seq_len" not in said and f"--lengths of at most {W - 8}" in said
    assert "--context-memory infllm" in said and f"set sliding_window null in {d}" in said


def test_plan_refuses_an_out_that_is_an_input(tmp_path):
    """`longctx plan --hardware hw.toml --out hw.toml` wrote the plan over the hardware file after the search
    (its _check_outputs compared no input); generate's check_output_path, now in durable.py, does."""
    from longctx.cli import build_parser
    from longctx.planner.cli import build_request

    hw = tmp_path / "hw.toml"
    hw.write_text('[hardware]\nbase = "h100"\n')
    for argv, said in ((("--hardware", str(hw), "--out", str(hw)), f"--out {hw} is also --hardware {hw}"),
                       (("--calibrate", "--calibrate-out", str(tmp_path / "c.toml"), "--out", str(tmp_path / "c.toml")),
                        "is also --calibrate-out")):
        args, rest = build_parser("plan").parse_known_args(["plan", "--gpus", "8", "--seq-len", "8K", *argv])
        with pytest.raises(ConfigError, match=re.escape(said)):
            build_request(args, rest)
    assert hw.read_text() == '[hardware]\nbase = "h100"\n'


def test_bench_decode_says_generates_dropless_note_for_a_capacity_target(tmp_path, monkeypatch, capsys):
    """bench decode decodes a MoE target with a capacity dropless, as generate does (generate/loading.py
    dropless_notes): its figures are of that model, which generate says and bench decode did not."""
    import longctx.bench.decode as bench_decode
    import longctx.generate.loading as loading
    from longctx.cli import main
    from longctx.config import load_config
    from longctx.data.tokenizer import ByteTokenizer

    cfg = load_config(overrides=["--model.preset=debug-moe", "--model.moe.capacity_factor=1.25"])
    monkeypatch.setattr(bench_decode, "_models", lambda args: (cfg, None, ByteTokenizer(), "byte"))
    monkeypatch.setattr(bench_decode, "_prompts", lambda *a: {"prompts": [[1, 2, 3]]})

    class Loaded(Exception):
        pass

    def load_model(*a, **k):
        raise Loaded  # (the notes come before any weight is read)

    monkeypatch.setattr(loading, "load_model", load_model)
    with pytest.raises(Loaded):
        main(["bench", "decode", "--target", "t", "--draft", "d"])
    err = " ".join(capsys.readouterr().err.split())
    assert "note: the model generates dropless: its moe.capacity_factor 1.25 is left out" in err, err[-800:]


@pytest.mark.parametrize("task, advice", [("ppl", "drop --context-memory"), ("passkey", "add --mode generate")])
def test_eval_context_memory_outside_generate_mode_gives_advice_the_task_takes(tmp_path, task, advice):
    """ppl has no generate mode (refused there): its refusal of --context-memory once said "add --mode generate"."""
    pytest.importorskip("transformers")
    import test_hf
    from test_tokenizer_follows_model import bpe_tokenizer

    from longctx.cli import build_parser
    from longctx.eval.request import prepare

    d, _ = test_hf.random_hf_dir(tmp_path, test_hf.hf_config("mistral", sliding_window=None))
    bpe_tokenizer(d / "tokenizer.json")
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 60)
    args, rest = build_parser("eval").parse_known_args(
        ["eval", "--checkpoint", f"hf:{d}", "--task", task, "--data", str(text), "--samples", "1",
         "--lengths", "64", "--context-memory", "infllm"])
    with pytest.raises(ConfigError) as e:
        prepare(args, rest, 1)
    assert advice in _said(e)


@pytest.mark.parametrize("alone", [["--draft", "DRAFT"], ["--context-memory", "infllm"]])
def test_a_batch_given_with_speculation_or_the_memory_is_refused(tmp_path, alone):
    """Both decode one prompt at a time: a --batch given with them was ignored (eval refuses it with the
    memory); its default, or 1, is no mistake."""
    d = _llama_dir(tmp_path / "hf")
    alone = [f"hf:{d}" if a == "DRAFT" else a for a in alone]
    with pytest.raises(ConfigError) as e:
        _prepare(d, "--prompt", "hello", *alone, "--batch", "4")
    which = "--draft" if alone[0] == "--draft" else "--context-memory infllm"
    assert _said(e) == f"--batch 4 does nothing with {which}, which decodes one prompt at a time: drop it."
    for batch in ("8", "1"):
        try:
            _prepare(d, "--prompt", "hello", *alone, "--batch", batch)
        except ConfigError as other:  # (a later check may refuse the stand-in model, never the batch)
            assert "--batch" not in str(other)
