"""`longctx eval --task ppl,passkey,needle`: several tasks in one launch, on the weights read once. Each task's
part of the JSON is exactly what that task alone writes (same flags, same seed: the same numbers), a flag
reaches the tasks that read it, and a bad list is refused before anything is read (eval/task_list.py).
The runs are in this process (longctx_here, seconds each), but for one of two ranks."""

import json

import pytest
from test_newcomer import flat, longctx, longctx_here

from longctx.config import load_config
from longctx.models.hf import save_hf
from longctx.models.llama import build_model

TEXT = "def f(x):\n    return x + 1\nclass A:\n    pass\nimport os\nprint(os.getcwd())\n" * 80
LENGTHS = ["--lengths", "384,512", "--samples", "2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(the --checkpoint and --data flags of a random one-layer model and a text file, the folder)."""
    tmp = tmp_path_factory.mktemp("tasklist")
    hf = save_hf(build_model(load_config(overrides=["--model.layers=1", "--model.vocab_size=320"]).model, seed=1),
                 tmp / "hf")
    (tmp / "filler.py").write_text(TEXT)
    return ["--checkpoint", f"hf:{hf}", "--tokenizer", "byte", "--data", str(tmp / "filler.py")], tmp


def _run(folder, out: str, *args, nproc: int = 0) -> tuple[dict, str]:
    """(the JSON --output holds, what the command said)."""
    flags, tmp = folder
    argv = ["eval", *flags, *LENGTHS, "--output", str(tmp / out), *args]
    r = longctx(*argv, "--nproc", str(nproc)) if nproc else longctx_here(*argv)
    assert r.returncode == 0, r.stderr
    return json.loads((tmp / out).read_text()), r.stdout + r.stderr


def _eval(folder, out: str, *args, nproc: int = 0) -> dict:
    return _run(folder, out, *args, nproc=nproc)[0]


def _timeless(result):
    """A result without its wall times (`seconds`, anywhere in it): the rest must be equal, exactly."""
    if isinstance(result, dict):
        return {k: _timeless(v) for k, v in result.items() if k != "seconds"}
    if isinstance(result, list):
        return [_timeless(v) for v in result]
    return result


def test_each_tasks_part_is_what_it_alone_writes(folder):
    """ppl, passkey and needle in one launch, --buckets for ppl and --depths for the other two: each part
    equals that task's own run key for key and number for number; what they share is at the top."""
    both, said = _run(folder, "all.json", "--task", "ppl,passkey,needle", "--depths", "0,1", "--buckets", "4")
    assert "eval: task 2 of 3: passkey (--mode score) at 384, 512 tokens" in said  # (progress names the task)
    assert said.count("weights: read from") == 1, said  # (the model built once)
    alone = {"ppl": _eval(folder, "ppl.json", "--task", "ppl", "--buckets", "4"),
             "passkey": _eval(folder, "passkey.json", "--task", "passkey", "--depths", "0,1"),
             "needle": _eval(folder, "needle.json", "--task", "needle", "--depths", "0,1")}
    assert list(both["tasks"]) == ["ppl", "passkey", "needle"]  # (the order given)
    for task, result in alone.items():
        assert "tasks" not in result and result["task"] == task  # (one task: its JSON as it always was)
        assert _timeless(both["tasks"][task]) == _timeless(result), task
    assert len(alone["ppl"]["results"][0]["buckets"]) == 4
    assert {r["depth"] for r in alone["passkey"]["results"]} == {0, 1}
    assert both["checkpoint"] == alone["ppl"]["checkpoint"] and both["lengths"] == [384, 512]
    assert both["mode"] == "score" and both["layout"] == alone["ppl"]["layout"] and both["seconds"] > 0
    _, tmp = folder
    assert all((tmp / f"all.{task}.png").is_file() for task in alone)  # (each task's plot, named for it)


def test_generate_mode_reaches_the_retrieval_tasks_and_ppl_is_scored(folder):
    """--mode generate with ppl listed between the retrieval tasks: passkey and needle answer by generation on
    one model, then ppl is scored (its model built after theirs: the weights read twice, not once per change
    of mode), each as alone, the JSON in the order given; `mode` differs, so it is in the parts only."""
    both, said = _run(folder, "mixed.json", "--task", "passkey,ppl,needle", "--mode", "generate", "--depths", "0.5",
                      "--buckets", "4")
    assert "the weights are read twice" in flat(said)
    assert "task 2 of 3: needle (--mode generate)" in flat(said) and "task 3 of 3: ppl (--mode score)" in flat(said)
    passkey = _eval(folder, "gen.json", "--task", "passkey", "--mode", "generate", "--depths", "0.5")
    needle = _eval(folder, "gen_needle.json", "--task", "needle", "--mode", "generate", "--depths", "0.5")
    ppl = _eval(folder, "ppl4.json", "--task", "ppl", "--buckets", "4")
    assert list(both["tasks"]) == ["passkey", "ppl", "needle"]
    assert _timeless(both["tasks"]) == {"passkey": _timeless(passkey), "ppl": _timeless(ppl),
                                        "needle": _timeless(needle)}
    assert "mode" not in both and both["tasks"]["passkey"]["mode"] == "generate"


def test_two_ranks_give_each_task_what_it_alone_gives(folder):
    """--nproc 2 (ctx 2): one launch of ppl and passkey, each part what that task's own 2-rank launch writes
    (three 2-rank launches: ~26 s on 2 cores)."""
    both = _eval(folder, "r2.json", "--task", "ppl,passkey", "--depths", "0.5", nproc=2)
    ppl = _eval(folder, "r2ppl.json", "--task", "ppl", nproc=2)
    passkey = _eval(folder, "r2pk.json", "--task", "passkey", "--depths", "0.5", nproc=2)
    assert both["layout"]["world"] == 2 and both["layout"]["ctx"] == 2
    assert _timeless(both["tasks"]) == {"ppl": _timeless(ppl), "passkey": _timeless(passkey)}


@pytest.mark.parametrize("task, needle", [
    ("ppl,pass", "'pass' is not a task; choose from ppl, passkey, needle"),
    ("ppl,needle,ppl", "names ppl more than once"),
    ("ppl,,needle", "has an empty item"),
    ("ppl,", "has an empty item"),
    ("", "has an empty item"),
])
def test_a_bad_task_list_is_refused_before_anything_is_read(task, needle):
    """A checkpoint that does not exist: the list is what is refused, before the weights are looked for."""
    r = longctx_here("eval", "--checkpoint", "hf:/no/such/model", "--task", task, "--lengths", "256")
    assert r.returncode == 2, r.stderr
    assert needle in flat(r.stderr) and "Traceback" not in r.stderr and "/no/such" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--task", "passkey,needle", "--buckets", "4"], "--buckets 4 sets ppl's position buckets, which --task passkey"),
    (["--task", "ppl", "--depths", "0.5"], "--depths 0.5 sets the needle's depths, which --task ppl does not have"),
    (["--task", "ppl,passkey", "--temperature", "1"], "--temperature applies to --mode generate"),
    (["--task", "ppl,needle", "--infllm-window", "64"], "--infllm-window 64 sizes InfLLM's context memory"),
])
def test_a_flag_no_listed_task_reads_is_refused_as_for_one_task(folder, args, needle):
    flags, _ = folder
    r = longctx_here("eval", *flags, "--lengths", "384", *args)
    assert r.returncode == 2, r.stderr
    assert needle in flat(r.stderr) and "Traceback" not in r.stderr


@pytest.mark.parametrize("given", [[], ["--plot", "fig.svg"]])
def test_an_unwritable_task_plot_is_named_as_the_user_gave_it(folder, given):
    """Several tasks, each its own plot beside --output (or --plot): one that cannot be written is refused before
    the weights are read, named as what the user passed, never as a --plot they did not pass."""
    flags, tmp = folder
    plot = tmp / ("fig.ppl.svg" if given else "unwritable.ppl.png")
    plot.mkdir()
    given = [given[0], str(tmp / given[1])] if given else []
    r = longctx_here("eval", *flags, "--lengths", "384", "--task", "ppl,passkey", "--output",
                     str(tmp / "unwritable.json"), *given)
    assert r.returncode == 2, r.stderr
    said, bare = flat(r.stderr), "".join(r.stderr.split())  # (bare: the message's wrapping may split the path)
    if given:
        assert "".join(f"the ppl plot (--plot's name with .ppl) {plot} is a directory".split()) in bare, said
    else:
        assert "".join(f"the ppl plot (--output's name with .ppl.png) {plot} is a directory".split()) in bare, said
        assert "--plot" not in said.replace("--plot's", ""), said
    assert "Traceback" not in r.stderr and not (tmp / "unwritable.json").exists()
