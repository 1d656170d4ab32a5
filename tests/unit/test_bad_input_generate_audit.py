"""Bad input to `longctx generate`, `eval`, `plan` and `bench` is one clear error before any work
(the project's rule: never a traceback after the model has loaded, never an option silently ignored,
never a result file written over an input). Each case here did otherwise before this audit:

- generate: --speculate / --confidence-stop / --draft-window without --draft, --cape-table without
  --cape and --infllm-* without --context-memory infllm were ignored without a word; --output in a
  missing directory or naming a directory raised from open() after the model had loaded and warmed
  up; --output = --prompts wrote the results over the prompts; --repetition-penalty inf ran; a
  --prompts line's own "max_tokens" or "temperature" was decoded with the flags' values.
- eval: --depths with --task ppl, --buckets with passkey / needle and --split with a text --data
  were ignored; --output naming
  a directory (or under a file) raised after the whole evaluation; --output = the --data text file
  overwrote it; a --plot of another suffix raised from matplotlib after the evaluation.
- plan: a --hw figure the cost model divides by at 0 raised ZeroDivisionError; a fraction given as a
  percentage (gemm_efficiency=70, usable_memory_fraction=92) planned 70x the peak or 92x the memory
  (a plan "fitting" in 424 GiB of an 80 GiB card); --expert-skew nan raised from the search; --top 0
  printed an empty table and --top -1 every row but the last; --out in a missing directory raised
  after the search; --calibrate-out without --calibrate was ignored; --recompute '' was blamed on
  the micro-batches.
- bench: sizes of zero (or a --top-k above the experts, an unknown layout) raised from deep inside
  (KeyError, ZeroDivisionError, a rank killed by SIGFPE) or printed figures of nothing.
"""

import argparse
import json
import math

import pytest

from longctx.errors import ConfigError

PROMPT = "hello there"


@pytest.fixture
def hf_dir(tmp_path):
    """A Llama config.json alone (what generate's and eval's checks read: no weights are needed before
    them), and a text file for eval's --data."""
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=160,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="float32", rope_theta=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text("the grass is green and the sky is blue. " * 200)
    return tmp_path


def _generate(d, *argv):
    from longctx.cli import build_parser
    from longctx.generate.cli import prepare

    args, rest = build_parser("generate").parse_known_args(["generate", "--checkpoint", f"hf:{d}", "--tokenizer",
                                                            "byte", "--max-new-tokens", "4", *argv])
    return prepare(args, rest)


@pytest.mark.parametrize("flags, said", [
    (("--speculate", "0"), "--speculate 0 does nothing without --draft"),
    (("--confidence-stop", "0.5"), "--confidence-stop 0.5 does nothing without --draft"),
    (("--draft-window", "5"), "--draft-window 5 does nothing without --draft"),
    (("--cape-table", "0.5:2,1:0"), "--cape-table 0.5:2,1:0 does nothing without --cape"),
    (("--infllm-window", "64", "--infllm-topk", "2"),
     "--infllm-topk 2, --infllm-window 64 do nothing without --context-memory infllm"),
    (("--ignore-eos", "--min-new-tokens", "3"), "--min-new-tokens 3 holds back EOS, which --ignore-eos"),
    # (the sharded prefill runs a rank's share in one call: the chunk would bound nothing)
    (("--nproc", "2", "--parallel.ctx", "2", "--prefill-chunk", "64"),
     "--prefill-chunk 64 does nothing with --nproc 2"),
])
def test_generate_refuses_a_flag_its_run_would_ignore(hf_dir, flags, said):
    with pytest.raises(ConfigError) as e:
        _generate(hf_dir, "--prompt", PROMPT, *flags)
    assert said in " ".join(str(e.value).split()), str(e.value)


def test_generate_takes_a_flag_at_its_default_and_each_flag_with_its_feature(hf_dir):
    # a value that changes nothing is no mistake (as greedy_filter_problem's rule): the default --speculate
    # 4 and --infllm-block 128 without their features, and --infllm-* with the memory, prepare as before
    request = _generate(hf_dir, "--prompt", PROMPT, "--speculate", "4", "--infllm-block", "128")
    assert request.limits == [4] and request.memory is None
    request = _generate(hf_dir, "--prompt", "x " * 40, "--context-memory", "infllm", "--infllm-window", "16",
                        "--infllm-block", "8", "--infllm-init", "8")
    assert (request.memory.window, request.memory.block) == (16, 8)


def test_generate_output_is_checked_before_the_weights(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        _generate(hf_dir, "--prompt", PROMPT, "--output", str(tmp_path))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'missing'} does not exist"):
        _generate(hf_dir, "--prompt", PROMPT, "--output", str(tmp_path / "missing" / "out.jsonl"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    before = prompts.read_text()
    with pytest.raises(ConfigError, match="is also --prompts .* would destroy that"):
        _generate(hf_dir, "--prompts", str(prompts), "--output", str(tmp_path / "." / "p.jsonl"))
    assert prompts.read_text() == before
    assert _generate(hf_dir, "--prompt", PROMPT, "--output", str(tmp_path / "out.jsonl")).limits == [4]


def test_generate_refuses_a_prompts_line_that_sets_a_runs_setting(hf_dir, tmp_path):
    # (a vLLM / OpenAI batch line's own limit or temperature was decoded with the flags' without a word;
    # a line's other keys, its metadata, stay free)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "source": "a"}) + "\n" +
                       json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0.7}) + "\n")
    with pytest.raises(ConfigError, match="line 2 sets 'max_tokens', 'temperature': decoding settings are the "
                                          "run's.*--max-new-tokens, --temperature"):
        _generate(hf_dir, "--prompts", str(prompts))
    prompts.write_text(json.dumps({"prompt": PROMPT, "source": "a", "id": 1, "seed": 2}) + "\n")
    assert len(_generate(hf_dir, "--prompts", str(prompts)).prompts) == 1


def test_generate_refuses_an_infinite_repetition_penalty(hf_dir):
    # (a positive logit / inf is 0 and a negative one x inf is -inf: no penalty's scale, and a row of
    # repeats all below 0 leaves no distribution)
    with pytest.raises(ConfigError, match="--repetition-penalty must be > 0 and finite"):
        _generate(hf_dir, "--prompt", PROMPT, "--repetition-penalty", "inf")


def _eval(d, *argv):
    from longctx.cli import build_parser
    from longctx.eval.request import prepare

    args, rest = build_parser("eval").parse_known_args(["eval", "--checkpoint", f"hf:{d}", "--tokenizer", "byte",
                                                        "--data", str(d / "text.txt"), "--samples", "1", *argv])
    return prepare(args, rest, 1)


@pytest.mark.parametrize("flags, said", [
    (("--task", "ppl", "--depths", "0.5"), "--depths 0.5 sets the needle's depths, which --task ppl does not"),
    (("--task", "passkey", "--buckets", "4"), "--buckets 4 sets ppl's position buckets, which --task passkey"),
    (("--task", "passkey", "--infllm-window", "64"), "--infllm-window 64 sizes InfLLM's context memory, which "
                                                    "this run does not use"),
    (("--task", "ppl", "--split", "train"), "--split train picks a store's split, but --data"),
])
def test_eval_refuses_a_flag_its_task_would_ignore(hf_dir, flags, said):
    with pytest.raises(ConfigError) as e:
        _eval(hf_dir, "--lengths", "128", *flags)
    assert said in " ".join(str(e.value).split()), str(e.value)


def test_eval_outputs_are_checked_before_the_evaluation(hf_dir, tmp_path):
    data = hf_dir / "text.txt"
    before = data.read_text()
    for flags, said in ((("--output", str(tmp_path)), "is a directory"),
                        (("--output", str(data / "r.json")), f"{data} is a file, not a directory"),
                        (("--output", str(data)), "is also --data"),
                        (("--output", str(tmp_path / "r.png")), "is also --output"),  # (the plot's default name)
                        (("--plot", str(tmp_path / "p.txt")), "the plot's format is its suffix"),
                        (("--plot", str(tmp_path / "plot")), "the plot's format is its suffix")):
        with pytest.raises(ConfigError, match=said):
            _eval(hf_dir, "--task", "ppl", "--lengths", "128", *flags)
    assert data.read_text() == before
    # eval makes --output's directories (eval/command.py): a missing one is no error
    request = _eval(hf_dir, "--task", "ppl", "--lengths", "128", "--output", str(tmp_path / "new" / "r.json"),
                    "--plot", str(tmp_path / "r.pdf"))
    assert request.lengths == [128] and len(request.sequences[128]) == 1


def _plan(*argv):
    from longctx.planner.cli import add_arguments, build_request

    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_request(p.parse_args(["--model", "debug", "--gpus", "8", "--seq-len", "4K", "--hardware", "h100",
                                       *argv]), [])


@pytest.mark.parametrize("hw, said", [
    ("peak_tflops=0", "peak_tflops = 0.0 must be > 0"),              # was ZeroDivisionError in the search
    ("intra_gbps=0", "intra_gbps = 0.0 must be > 0"),
    ("host_link_gbps=0", "host_link_gbps = 0.0 must be > 0"),
    ("attention_efficiency=0", "attention_efficiency = 0.0 must be > 0"),
    ("gemm_efficiency=70", "gemm_efficiency = 70.0 must be a fraction in [0, 1]"),  # was MFU 110.7%
    ("usable_memory_fraction=92", "usable_memory_fraction = 92.0 must be a fraction"),  # was 424 GiB "fitting"
    ("comm_overlap=5", "comm_overlap = 5.0 must be a fraction"),
    ("usable_host_fraction=0", "usable_host_fraction = 0.0 must be > 0 with host memory"),
    ("dtype_bytes=3", "dtype_bytes = 3 must be 2 (bf16) or 4 (fp32)"),
])
def test_plan_refuses_hardware_figures_out_of_their_meaning(hw, said):
    with pytest.raises(ConfigError, match=f"hardware h100: {re_escape(said)}"):
        _plan("--hw", hw)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_plan_takes_a_measured_cpus_figures():
    # (cpu-measured's: no host memory and its fraction 0, attention above the GEMM rate, no overlap)
    req, _ = _plan("--hw", "host_memory_gib=0", "--hw", "usable_host_fraction=0", "--hw", "attention_efficiency=1.4",
                   "--hw", "comm_overlap=0", "--hw", "dtype_bytes=2")
    assert req.hardware.attention_efficiency == 1.4 and req.hardware.usable_host_fraction == 0


def test_plan_refuses_its_other_bad_flags_before_planning(tmp_path):
    for argv, said in ((("--top", "0"), "--top is the number of rows .* at least 1; got 0"),
                       (("--top", "-1"), "at least 1; got -1"),
                       (("--expert-skew", "nan"), "the expert skew is the most loaded"),
                       (("--recompute", ""), "--recompute names no policy"),
                       (("--calibrate-out", str(tmp_path / "hw.toml")), "writes what --calibrate measures"),
                       (("--out", str(tmp_path)), "is a directory"),
                       (("--out", str(tmp_path / "missing" / "plan.toml")), "does not exist")):
        with pytest.raises(ConfigError, match=said):
            _plan(*argv)
    req, _ = _plan("--out", str(tmp_path / "plan.toml"), "--top", "1")
    assert req.gpus == 8 and not (tmp_path / "plan.toml").exists()  # (written after the search only)
    assert math.isinf(_plan("--expert-skew", "max")[0].expert_skew)


def _bench(*argv):
    from longctx.cli import build_parser

    args, _ = build_parser("bench").parse_known_args(["bench", *argv])
    return args


@pytest.mark.parametrize("argv, said", [
    (("generate", "--prompt-len", "0"), "--prompt-len must be >= 1, got 0"),      # was ValueError after building
    (("generate", "--new-tokens", "0"), "--new-tokens must be >= 2, got 0"),      # was transformers' ValueError
    (("generate", "--heads", "3", "--kv-heads", "2"), "--kv-heads 2 must divide --heads 3"),
    (("generate", "--memory-lengths", "0"), "'0' is not a positive token count"),  # was UnboundLocalError
    (("generate", "--sharded", "0x2"), "--sharded '0x2': write HxC"),               # was max() of nothing
    (("decode", "--target", "t", "--draft", "d", "--max-new-tokens", "0"), "--max-new-tokens must be >= 2"),
    (("attention", "--seq-len", "0"), "--seq-len must be >= 2, got 0"),           # was a rank killed (SIGFPE)
    (("attention", "--head-dim", "0"), "--head-dim must be >= 1, got 0"),
    (("attention", "--world", "4", "--ctx", "4", "--window", "3"), "--window 3 must be 0 (a plain ring) or divide"),
    (("train", "--layouts", "dp"), "--layouts dp: choose among single"),          # was KeyError: 'dp'
    (("train", "--global-batch", "0"), "--global-batch must be >= 1, got 0"),
    (("train", "--presets", "debug,nope"), "--presets nope: choose among debug"),  # was a JSON row per layout
    (("memory", "--micro-batch", "0"), "--micro-batch must be >= 1, got 0"),      # was ZeroDivisionError
    (("memory", "--policies", "bogus"), "--policies bogus: unknown policy"),      # was ValueError
    (("memory", "--layers", "-1"), "--layers must be >= 0, got -1"),
    (("moe", "--experts", "4", "--top-k", "5"), "--top-k 5 is more than the 4 --experts"),  # was topk RuntimeError
    (("moe", "--top-k", "0"), "--top-k must be >= 1, got 0"),
    (("moe", "--skew-share", "-0.5"), "--skew-share -0.5: expert 0's share"),     # was said after a first case
    (("comm", "--cluster", "2x1", "--intra-gbps", "0"), "--intra-gbps must be > 0, got 0.0"),
    # (bench audit, 2026-12-02: each of these died in a rank or after the work, or printed figures of nothing)
    (("generate", "--new-tokens", "1"), "--new-tokens must be >= 2, got 1"),       # was ZeroDivisionError after
    (("decode", "--target", "t", "--draft", "d", "--max-new-tokens", "1"), "--max-new-tokens must be >= 2"),  # 0x
    (("train", "--seq-len", "100", "--layouts", "ctx4"), "layout ctx4 needs a multiple of 2 x head x ctx = 8"),
    (("train", "--global-batch", "3", "--layouts", "dp2-ctx2"), "layout dp2-ctx2 splits it over dp 2"),
    (("memory", "--seq-len", "100", "--ctx", "4"), "a multiple of 2 x head x ctx = 8"),   # was a rank's traceback
    (("moe", "--routing", "skwed"), "--routing skwed: one of uniform, skewed"),  # GPU path ran it as uniform
    (("moe", "--routing", ","), "--routing ',' names no routing"),  # was rc 0 with no timing row
    (("moe", "--cluster", "2x1", "--layers", "-1"), "--layers must be >= 0, got -1"),   # was a step of no layers
    (("moe", "--cluster", "2x1", "--tokens", "0"), "--tokens must be >= 1, got 0"),     # was ZeroDivisionError
    (("moe", "--cluster", "2x1", "--link-scale", "0"), "--link-scale must be > 0"),
    (("moe", "--cluster", "2x1", "--chunks", "two"), "--chunks 'two'"),
    (("moe", "--cluster", "2x1", "--slowdown", "x"), "--slowdown 'x'"),
    (("moe", "--cluster", "2x1", "--model", "debug"), "--model debug has no MoE layers"),
    (("comm", "--cluster", "2x1", "--steps", "-1"), "--steps must be >= 0, got -1"),   # was a final_loss of -1 steps
])
def test_bench_sizes_are_checked_before_any_work(argv, said):
    from longctx.bench.arg_checks import check_bench_args

    with pytest.raises(ConfigError, match=re_escape(said)):
        check_bench_args(argv[0], _bench(*argv))


def test_bench_comm_refuses_a_co2_merge_past_its_round():
    """--co2-overlap-steps above --co2-local-steps was refused by co2's config inside the ranks, after every
    mode before co2 had been timed (a traceback)."""
    from longctx.bench.comm_cluster import main

    with pytest.raises(ConfigError, match="--co2-overlap-steps 9"):
        main(_bench("comm", "--cluster", "2x1", "--modes", "fsdp,co2", "--co2-overlap-steps", "9"))


def test_bench_defaults_pass():
    from longctx.bench.arg_checks import check_bench_args

    for argv in (("generate",), ("decode", "--target", "t", "--draft", "d"), ("attention",), ("train",),
                 ("memory",), ("moe",), ("comm", "--cluster", "2x1"),
                 ("moe", "--top-k", "4", "--routing", "uniform")):  # (--skew-share is read by skewed runs only)
        check_bench_args(argv[0], _bench(*argv))


def test_bench_command_checks_before_its_work(capsys):
    from longctx.cli import main

    # through the command line: the error, not a KeyError from the layouts' table
    assert main(["bench", "train", "--layouts", "dp"]) == 2
    assert "--layouts dp: choose among single" in " ".join(capsys.readouterr().err.split())
