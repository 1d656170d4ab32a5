"""data.path with a trailing comma or spaces ("stores/a," or "stores/a "): the mix helpers (is_mix, first_store,
run_tokenizer) stripped it while store_path and the data preflight read it raw, so the user was told
"'stores/a,' is not a longctx data store". The config normalises data.path once, where it is built, so every
reader sees the same stores; a data.path of commas and spaces alone names no store and is refused as that."""

import random

import pytest

from longctx.config import load_config
from longctx.data.builder.options import BuildOptions
from longctx.data.builder.pipeline import build_store
from longctx.errors import ConfigError
from longctx.train.setup import build_data, run_tokenizer, store_path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("normal_path")
    (tmp / "in").mkdir()
    rng = random.Random(0)
    for i in range(6):
        (tmp / "in" / f"d{i}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef"]) for _ in range(30)) + f" {i}")
    build_store(BuildOptions([str(tmp / "in")], str(tmp / "a"), 64, strategy="bfd", dedup="none", workers=1,
                             progress=False, stats=False), log=lambda *a, **k: None)
    return tmp / "a"


@pytest.mark.parametrize("given", ["{},", "{} ", " {}", "{}, ", ",{},"])
def test_one_store_with_a_stray_comma_or_space_is_that_store(store, given):
    cfg = load_config(None, {"data": {"path": given.format(store)}, "train": {"seq_len": 64}})
    assert cfg.data.path == str(store)
    assert store_path(cfg, print, None) == str(store)
    train, _ = build_data(cfg, log=lambda *a: None)
    assert len(train) > 0
    assert run_tokenizer(cfg) == "byte"


def test_several_stores_are_joined_by_plain_commas(store):
    other = store.parent / "b"  # (not read here: the config alone)
    cfg = load_config(None, {"data": {"path": f" {store} ,, {other} ,"}, "train": {"seq_len": 64}})
    assert cfg.data.path == f"{store},{other}"


@pytest.mark.parametrize("given", [",", " ", " , "])
def test_a_path_of_commas_and_spaces_names_no_store(given):
    with pytest.raises(ConfigError, match="names no store .*give the path of a store"):
        load_config(None, {"data": {"path": given}})


def test_the_command_line_is_normalised_too(store):
    cfg = load_config(None, [f"--data.path={store},", "--train.seq_len=64"])
    assert cfg.data.path == str(store)
