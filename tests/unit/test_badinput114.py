"""Every key of `longctx train`, walked with bad values (badinput114): each is refused with a ConfigError (or
another UserError) that names the key, before any work, or accepted because it means something (ALLOWED says
what); never a raw traceback, never a value taken and then used wrongly.

The walk runs `longctx train`'s own path up to its first step: cli._cmd_train (the layout rule, the config's
rules, Ms-PoE's refusal), then preflight (job/checks.py check_layout, the paths, the data store, the host
memory), with the step-taking train() and the launcher's relaunch replaced by a stop. Each key is walked
where it is read (CONTEXT: the yarn keys under yarn, [model.moe] on a MoE model, qwz's block on 2 ranks, the
draft keys against a target), so that an accepted value is one a run would use.

Bad values by type: an integer -1, 0 and 'abc'; a number nan, inf, -1.0 and 'abc'; a boolean 'maybe'; a
string with choices or a syntax of its own 'bogus'; a path a run reads, one that does not exist. And in TOML
(a dict of typed values), a value of the wrong type for every key.

Wrong on HEAD: parallel.zero_pp_block 0 or -1 under qwz / qgz passed every check before launch (the ranks
refused it at set-up, after the data store was built); model.rope_mscale / model.rope_mscale_all_dim below 0
under yarn were taken (a raw ZeroDivisionError in preflight's host-memory estimate where mscale_all_dim makes
YaRN's divisor 0, else an attention factor no YaRN config means: 1.53 for mscale 1, mscale_all_dim -1); a second
degree of -1 (parallel.dp_replicate, head or ctx beside dp_shard's default -1) was refused without naming the
keys ('got -1 for dp_replicate, dp_shard') or saying what to do."""

from __future__ import annotations

import dataclasses

import pytest

import longctx.job.relaunch as relaunch_module
import longctx.threads as threads_module
import longctx.train.preflight as preflight_module
import longctx.train.trainer as trainer_module
from longctx import cli
from longctx.config import load_config
from longctx.config.fields import SECTIONS, _base_type, fields_by_key
from longctx.errors import UserError
from probes import DRAFT_QUIET, tiny_target_run

MOE = ["--model.preset=debug-moe"]
YARN = ["--model.rope_scaling=yarn", "--model.max_seq_len=64"]
HPZ = ["--parallel.zero_pp=hpz", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.global_batch=4"]
MS_POE = "--model.rope_ms_poe=true"
# what train says of Ms-PoE (a generate / eval option) once its settings passed the config's rules: its keys' walk
# counts it as the end of the checks
MS_POE_IN_TRAINING = "ConfigError: model.rope_ms_poe is a position option for longctx generate and longctx eval"
TARGET = "<target>"  # the module's tiny target checkpoint (draft.target)

# (key prefix, flags that make the key live, ranks): the first prefix that matches a key is its context
CONTEXT = [
    ("model.rope_low_freq_factor", ["--model.rope_scaling=llama3"], 1),
    ("model.rope_high_freq_factor", ["--model.rope_scaling=llama3"], 1),
    ("model.rope_ms_poe_", [MS_POE], 1),  # (train then refuses Ms-PoE itself: MS_POE_IN_TRAINING)
    ("model.rope_", YARN, 1),
    ("model.moe.groups", [*MOE, "--model.moe.router=sigmoid"], 1),
    ("model.moe.topk_groups", [*MOE, "--model.moe.router=sigmoid", "--model.moe.groups=2"], 1),
    ("model.moe.dts_", [*MOE, "--model.moe.router=dts"], 1),
    ("model.moe.sinkhorn", [*MOE, "--model.moe.router=sinkhorn"], 1),
    ("model.moe.shared_dim", [*MOE, "--model.moe.shared_experts=1"], 1),
    ("model.moe.", MOE, 1),
    ("parallel.expert", [*MOE, "--parallel.expert=2"], 2),
    ("parallel.zero_pp_", ["--parallel.zero_pp=qwz"], 2),
    ("parallel.hpz_ranks", [*HPZ, "--parallel.ranks_per_node=2"], 4),
    ("parallel.ranks_per_node", ["--parallel.zero_pp=qgz", "--train.global_batch=4"], 4),
    ("parallel.grad_bucket_blocks", ["--parallel.dp_shard=2"], 2),
    ("train.co2_", ["--train.data_parallel=co2", "--parallel.dp_replicate=2", "--parallel.dp_shard=1"], 2),
    ("memory.offload", ["--memory.recompute=selective"], 1),
    ("memory.block_chunk", ["--memory.recompute=selective"], 1),
    ("memory.attention_offload", ["--memory.attention_chunk=16"], 1),
    ("memory.expert_chunk", MOE, 1),
    ("draft.", [f"--draft.target={TARGET}"], 1),
    ("", [], 1),
]

# paths a run reads (a missing one must be refused) and paths it writes (a missing one is made)
READ_PATHS = {"model.init_from", "data.corpus", "data.tokenizer", "data.path", "checkpoint.resume", "draft.target"}
WRITTEN_PATHS = {"train.run_dir", "checkpoint.dir", "metrics.file"}
MISSING = "/nonexistent-badinput114/x"

# (key, value) accepted because it means something, and what
ALLOWED = {
    ("model.head_dim", "0"): "0 = dim // heads",
    ("model.padding_idx", "-1"): "-1 = no row without gradient",
    ("model.padding_idx", "0"): "token 0's row gets no gradient (a pad id like any other)",
    ("model.rope_ms_poe_skip_layers", "0"): "Ms-PoE on every layer",
    ("model.moe.experts", "0"): "a dense model",
    ("model.moe.expert_dim", "0"): "0 = ffn_dim",
    ("model.moe.shared_experts", "0"): "no shared experts",
    ("model.moe.shared_dim", "0"): "0 = shared_experts x expert_dim",
    ("model.moe.dts_steps", "0"): "no warm-up: top_k at temperature 1 from the first step (DTSRouter.schedule)",
    ("model.moe.sinkhorn_iters", "0"): "the balanced assignment straight on the router's logits (no normalising)",
    ("parallel.dp_shard", "-1"): "-1 = whatever the world size leaves",
    ("parallel.window", "0"): "0 = a plain ring",
    ("parallel.expert_pipeline_chunks", "0"): "0 = chosen by an online profile of the first steps",
    ("parallel.expert_replicas", "0"): "0 = every expert on its owner only",
    ("parallel.expert_ranks_per_node", "0"): "0 = a flat all-to-all",
    ("parallel.ranks_per_node", "0"): "0 = the launcher's",
    ("parallel.hpz_ranks", "0"): "0 = a node's ranks",
    ("parallel.grad_bucket_blocks", "0"): "0 = chosen by the cost model",
    ("train.warmup_steps", "0"): "no warmup",
    ("train.skip_limit", "0"): "no limit on skipped steps in a row",
    ("train.seed", "0"): "a seed like any other",
    ("train.co2_sync_steps", "0"): "local rounds from step 1",
    ("train.co2_overlap_steps", "0"): "0 = co2_local_steps",
    ("train.eval_interval", "0"): "no evaluation",
    ("data.max_docs", "0"): "every document",
    ("memory.offload_skip_last", "0"): "every block may be offloaded",
    ("memory.block_chunk", "0"): "whole blocks",
    ("memory.attention_chunk", "0"): "the attention core over all of a rank's tokens at once",
    ("memory.expert_chunk", "0"): "the experts' rows at once",
    ("memory.loss_chunk", "0"): "never chunk the loss",
    ("checkpoint.interval", "0"): "no periodic saves",
    ("metrics.profile_step", "0"): "no profile",
    ("draft.vocab", "0"): "the target's vocabulary",
    **{(key, MISSING): "a directory the run writes is made" for key in WRITTEN_PATHS},
}


def all_keys() -> list[tuple[str, dataclasses.Field]]:
    return [(f"{section}.{key}", f) for section, cls in SECTIONS.items() for key, f in fields_by_key(cls).items()]


def bad_values(key: str, f: dataclasses.Field) -> list[str]:
    kind = _base_type(f)
    if kind == "int":
        return ["-1", "0", "abc"]
    if kind == "float":
        return ["nan", "inf", "-1.0", "abc"]
    if kind == "bool":
        return ["maybe"]
    return [MISSING] if key in READ_PATHS | WRITTEN_PATHS else ["bogus"]


def context(key: str) -> tuple[list[str], int]:
    return next((flags, nproc) for prefix, flags, nproc in CONTEXT if key.startswith(prefix))


class Reached(Exception):
    """The run got past every check to its first step."""


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target_run(tmp_path_factory.mktemp("badinput114"))


@pytest.fixture
def walk(target, tmp_path, monkeypatch):
    """attempt(key, value, flags, nproc): 'accepted', or the refusal's type and message."""
    corpus, checkpoints = target

    def stop(*_a, **_k):
        raise Reached

    checked = []

    def preflight(*a, **k):
        checked.append(1)
        return real_preflight(*a, **k)

    real_preflight = preflight_module.preflight
    monkeypatch.setattr(preflight_module, "preflight", preflight)  # (what a stop must have come through)
    monkeypatch.setattr(trainer_module, "train", stop)  # (cli._train imports them when called)
    monkeypatch.setattr(relaunch_module, "relaunch", stop)
    monkeypatch.setattr(threads_module, "fit_to_idle_cores", lambda *a, **k: None)  # (0.3 s of sampling each)
    runs = iter(range(10**6))

    def attempt(key: str, value: str, flags: list[str], nproc: int) -> str:
        flags = [flag.replace(TARGET, str(checkpoints)) for flag in flags]
        given = [f"--{key}={value}"] if key else []
        argv = ["train", "--nproc", str(nproc), f"--train.run_dir={tmp_path / str(next(runs))}", *DRAFT_QUIET,
                *corpus, "--train.steps=3", "--metrics.peak_tflops=1", *flags, *given]
        args, rest = cli.build_parser("train").parse_known_args(argv)
        checked.clear()
        try:
            cli._cmd_train(args, rest)
        except Reached:
            return "accepted" if checked else "reached the first step without the preflight"
        except UserError as e:
            said = f"{type(e).__name__}: {' '.join(str(e).split())}"
            return "accepted" if MS_POE in flags and said.startswith(MS_POE_IN_TRAINING) else said
        return "returned without training"

    return attempt


@pytest.mark.parametrize("prefix,flags,nproc", CONTEXT, ids=[c[0] or "plain" for c in CONTEXT])
def test_each_context_reaches_the_first_step(walk, prefix, flags, nproc):
    """A context refused for its own sake would make the walk's refusals say nothing of the key walked."""
    assert walk("", "", flags, nproc) == "accepted"


def _walked_keys():
    return [pytest.param(key, f, id=key) for key, f in all_keys()]


@pytest.mark.parametrize("key,f", _walked_keys())
def test_every_bad_value_is_refused_naming_its_key_or_means_something(walk, key, f):
    flags, nproc = context(key)
    wrong = []
    for value in bad_values(key, f):
        try:
            said = walk(key, value, flags, nproc)
        except Exception as e:  # noqa: BLE001 - a raw traceback is what the walk reports
            wrong.append(f"--{key}={value}: {type(e).__name__} {e}")
            continue
        allowed = ALLOWED.get((key, value))
        if said == "accepted":
            if allowed is None:
                wrong.append(f"--{key}={value}: accepted (not in ALLOWED)")
        elif allowed is not None:
            wrong.append(f"--{key}={value}: ALLOWED ({allowed}) but refused: {said}")
        elif key not in said:
            wrong.append(f"--{key}={value}: refused without naming the key: {said}")
    assert not wrong, "\n".join(wrong)


def test_a_yarn_mscale_that_makes_its_divisor_zero_is_refused_not_a_zero_division(walk):
    """0.1 x mscale_all_dim x ln(8) + 1 is exactly 0 at this value: preflight's host-memory estimate, which builds
    the model, stopped on a raw ZeroDivisionError (models/llama.py rope_attention_scale)."""
    said = walk("model.rope_mscale_all_dim", "-4.8089834696298785", [*YARN, "--model.rope_mscale=1"], 1)
    assert said.startswith("ConfigError: model.rope_mscale_all_dim must be >= 0 (0 = unset"), said


def _wrong_type(f: dataclasses.Field):
    return {"int": "abc", "float": "abc", "bool": "maybe"}.get(_base_type(f), 5)


@pytest.mark.parametrize("key,f", _walked_keys())
def test_a_toml_value_of_the_wrong_type_is_refused_naming_its_key(key, f):
    section, name = key.split(".", 1)
    with pytest.raises(UserError) as e:
        load_config(overrides={section: {name: _wrong_type(f)}})
    assert key in str(e.value)


def test_allowed_names_only_keys_and_values_the_walk_tries():
    """ALLOWED stays honest: every entry is a value the walk gives its key."""
    tried = {(key, value) for key, f in all_keys() for value in bad_values(key, f)}
    assert set(ALLOWED) <= tried, set(ALLOWED) - tried
