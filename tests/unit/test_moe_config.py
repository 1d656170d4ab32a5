"""[model.moe] as input: each bad value or combination is one clear ConfigError, raised before any
work (no run directory, no process); the keys parse from the command line, from a TOML
[model.moe] table, and round-trip through a written config.toml."""

import pytest

from longctx.cli import main
from longctx.config import build_model_config, load_config, to_dict, to_toml
from longctx.config.moe_rules import moe_rules
from longctx.errors import ConfigError

MOE = ["--model.preset=debug-moe"]

BAD = {
    "top_k above experts": (["--model.moe.top_k=9"], "model.moe.top_k (9) must be between 1 and model.moe.experts (8)"),
    "top_k 0": (["--model.moe.top_k=0"], "model.moe.top_k (0) must be between 1"),
    "unknown router": (["--model.moe.router=topk"], "model.moe.router = 'topk' is not one of the valid choices: "
                                                    "softmax, switch, sigmoid, sinkhorn, dts"),
    "unknown aux_loss_scope": (["--model.moe.aux_loss_scope=mean"], "model.moe.aux_loss_scope = 'mean' is not one of "
                                                                  "the valid choices: per_layer_mean, per_layer_sum, "
                                                                  "pooled"),
    "unknown dts_eval": (["--model.moe.router=dts", "--model.moe.dts_eval=greedy"],
                         "model.moe.dts_eval = 'greedy' is not one of the valid choices: schedule, top_k"),
    "groups not dividing experts": (["--model.moe.router=sigmoid", "--model.moe.groups=3"],
                                    "model.moe.groups (3) must divide model.moe.experts (8)"),
    "topk_groups above groups": (["--model.moe.router=sigmoid", "--model.moe.groups=4", "--model.moe.topk_groups=5"],
                                 "model.moe.topk_groups (5) must be between 1 and model.moe.groups (4)"),
    "top_k above the allowed groups": (["--model.moe.router=sigmoid", "--model.moe.top_k=3", "--model.moe.groups=4",
                                        "--model.moe.topk_groups=1"],
                                       "model.moe.top_k (3) is more than the experts in model.moe.topk_groups (1)"),
    "groups without the sigmoid router": (["--model.moe.groups=2"], "router softmax has no groups"),
    "switch with top_k 2": (["--model.moe.router=switch"], "set --model.moe.top_k 1"),
    "capacity with sinkhorn": (["--model.moe.router=sinkhorn", "--model.moe.capacity_factor=1.25"],
                               "router sinkhorn balances its assignment itself"),
    "capacity with dts": (["--model.moe.router=dts", "--model.moe.capacity_factor=1.25"],
                          "router dts sends every token to every expert early on"),
    "dense_layers out of range": (["--model.moe.dense_layers=0,7"],
                                  "model.moe.dense_layers names layers [7], but the model has 4 (0-3)"),
    "dense_layers unreadable": (["--model.moe.dense_layers=a-b"], "model.moe.dense_layers: cannot read 'a-b'"),
    "all layers dense": (["--model.moe.dense_layers=0-3"], "model.moe.dense_layers makes every layer dense"),
    "shared_gate without shared experts": (["--model.moe.shared_gate=true"],
                                           "model.moe.shared_gate gates the shared experts, but there are none"),
    "negative capacity": (["--model.moe.capacity_factor=-1"], "model.moe.capacity_factor must be >= 0"),
    "negative experts": (["--model.moe.experts=-2"], "model.moe.experts must be >= 0"),
    "bias with sinkhorn": (["--model.moe.router=sinkhorn", "--model.moe.bias_update_rate=0.001"],
                           "router sinkhorn balances its assignment itself: set one of them"),
    "dts temperature 0": (["--model.moe.router=dts", "--model.moe.dts_temperature=0"],
                          "model.moe.dts_temperature must be positive"),
    "MoE family with experts 0": (["--model.preset=mixtral-8x7b", "--model.layers=2", "--model.moe.experts=0"],
                                  "model.family = mixtral is a Mixture-of-Experts family but model.moe.experts is 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_moe_input_is_one_clear_config_error(case):
    args, needle = BAD[case]
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[*MOE, *args])
    assert needle in str(e.value)


def _problems(args):
    """What the [model.moe] rules say about a model config (parsed, not validated)."""
    values = {}
    for a in [*MOE, *args]:
        key, value = a.removeprefix("--model.").split("=", 1)
        values[key] = value
    from longctx.config.load import parse_overrides

    values = parse_overrides([f"--model.{k}={v}" for k, v in values.items()])["model"]
    problems = []
    moe_rules(build_model_config(values), problems)
    return problems


@pytest.mark.parametrize("case", [c for c in BAD if not c.startswith("unknown ")])  # (choices: the loader's check)
def test_each_bad_input_is_named_once(case):
    """One mistake, one sentence: the rules do not pile a second complaint on the same mistake."""
    args, needle = BAD[case]
    problems = _problems(args)
    assert len(problems) == 1 and needle in problems[0], problems


def test_good_moe_configs_have_no_problems():
    for args in ([], ["--model.moe.router=sigmoid", "--model.moe.groups=4", "--model.moe.topk_groups=2"],
                 ["--model.moe.router=switch", "--model.moe.top_k=1", "--model.moe.capacity_factor=1.25"],
                 ["--model.moe.router=sinkhorn"], ["--model.moe.router=dts"],
                 ["--model.moe.shared_experts=1", "--model.moe.shared_gate=true"], ["--model.moe.experts=0"]):
        assert _problems(args) == [], args
        load_config(overrides=[*MOE, *args])


@pytest.mark.parametrize("case", ["top_k above experts", "unknown router", "capacity with sinkhorn",
                                  "dense_layers unreadable", "MoE family with experts 0"])
def test_longctx_train_stops_before_any_work(case, tmp_path, capsys):
    args, needle = BAD[case]
    run_dir = tmp_path / "run"
    code = main(["train", "--nproc", "1", *MOE, *args, f"--train.run_dir={run_dir}", "--train.steps=1"])
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code != 0
    assert "longctx train: error:" in err and " ".join(needle.split()) in " ".join(err.split())
    assert err.count("error:") == 1
    assert not run_dir.exists()


def test_moe_keys_from_the_command_line():
    cfg = load_config(overrides=["--model.moe.experts", "8", "--model.moe.top_k", "1", "--model.moe.router",
                                 "switch", "--model.moe.capacity_factor=1.5", "--model.moe.shared_gate",
                                 "--model.moe.shared_experts", "1"])
    m = cfg.model
    assert (m.moe_experts, m.moe_top_k, m.moe_router, m.moe_capacity_factor) == (8, 1, "switch", 1.5)
    assert m.moe_shared_gate is True and m.moe_shared_experts == 1 and m.is_moe
    assert isinstance(m.moe_capacity_factor, float)
    assert m.moe_layer_ids == (0, 1, 2, 3)  # the debug preset: every layer MoE


def test_moe_table_in_a_toml_file(tmp_path):
    p = tmp_path / "moe.toml"
    p.write_text('[model]\npreset = "debug"\n\n[model.moe]\nexperts = 8\ntop_k = 2\nrouter = "sigmoid"\ngroups = 4\n'
                 'topk_groups = 2\ndense_layers = "0"\nbias_update_rate = 0.001\n')
    m = load_config(p).model
    assert (m.moe_experts, m.moe_top_k, m.moe_router, m.moe_groups, m.moe_topk_groups) == (8, 2, "sigmoid", 4, 2)
    assert m.moe_layer_ids == (1, 2, 3) and m.moe_bias_update_rate == 0.001
    # the command line on top of the file
    assert load_config(p, ["--model.moe.experts=16"]).model.moe_experts == 16
    # a misspelt key in the table is named with its section
    p.write_text('[model.moe]\nexperts = 8\ntopk = 2\n')
    with pytest.raises(ConfigError, match="unknown config key 'model.moe.topk'"):
        load_config(p)


@pytest.mark.parametrize("args", [
    [],
    ["--model.moe.router=sigmoid", "--model.moe.groups=4", "--model.moe.topk_groups=2", "--model.moe.dense_layers=0-1",
     "--model.moe.route_scale=2.5", "--model.moe.norm_topk=false", "--model.moe.bias_update_rate=0.001"],
    ["--model.moe.router=switch", "--model.moe.top_k=1", "--model.moe.capacity_factor=1.25",
     "--model.moe.shared_experts=2", "--model.moe.shared_gate=true", "--model.moe.z_loss=0.01",
     "--model.moe.aux_loss_scope=pooled"],
    ["--model.moe.router=dts", "--model.moe.dts_steps=50", "--model.moe.dts_temperature=3.0",
     "--model.moe.dts_eval=top_k"],
])
def test_written_config_round_trips(args, tmp_path):
    cfg = load_config(overrides=[*MOE, *args])
    text = to_toml(cfg)
    assert "moe.experts = 8" in text
    p = tmp_path / "config.toml"
    p.write_text(text)
    again = load_config(p)
    assert to_dict(again) == to_dict(cfg)
    assert to_toml(again) == text


def test_top1_with_renormalised_weights_is_said():
    """Top-1 with norm_topk: every weight is 1 (transformers' rule), so the router gets no gradient from the
    model's loss; the run says so once (not an error: an HF top-1 model is meant to train that way)."""
    from longctx.config.moe_rules import moe_notes

    [note] = moe_notes(load_config(overrides=[*MOE, "--model.moe.top_k=1"]).model)
    assert "every routing weight is 1" in note and "--model.moe.norm_topk false" in note
    assert moe_notes(load_config(overrides=[*MOE, "--model.moe.top_k=1", "--model.moe.norm_topk=false"]).model) == []
    assert moe_notes(load_config(overrides=[*MOE, "--model.moe.top_k=1", "--model.moe.router=switch"]).model) == []
    assert moe_notes(load_config(overrides=MOE).model) == []  # top-2
