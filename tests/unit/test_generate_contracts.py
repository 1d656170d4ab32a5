"""generate/contracts.py: every implementation satisfies its Protocol.

- by the class: each method and property a Protocol names exists on each implementation, with the
  Protocol's parameters (names, kinds, defaults), so a caller written against the contract can call
  any of them alike;
- by the instance: isinstance on the runtime-checkable Protocols (data members included) for the
  one-device cache, backend, drafters and rounds (the sharded cache and backend:
  tests/distributed/test_sharded_generation_contracts.py, on two ranks);
- the decode loop and the speculative round are written against the contracts alone (no concrete
  cache, backend or drafter named in their modules).
"""

import ast
import inspect
from pathlib import Path

import pytest
import torch

from longctx.config import load_config
from longctx.generate import contracts
from longctx.generate.cape import CapeTable
from longctx.generate.drafters import GlideDrafter, ModelDrafter
from longctx.generate.engine import PlainRounds
from longctx.generate.local import LOCAL, LocalGeneration
from longctx.generate.sampling import GREEDY
from longctx.generate.sharded import ShardedGeneration, ShardedKVCache, _ShardedLayer
from longctx.generate.speculative import SpeculativeRounds
from longctx.models.kv_cache import KVCache, LayerCache
from longctx.models.llama import build_model

IMPLEMENTATIONS = {
    contracts.Cache: [KVCache, ShardedKVCache],
    contracts.CacheLayer: [LayerCache, _ShardedLayer],
    contracts.Backend: [LocalGeneration, ShardedGeneration],
    contracts.FlatPrefill: [LocalGeneration],
    contracts.LeasedCaches: [LocalGeneration],
    contracts.Drafter: [ModelDrafter, GlideDrafter],
    contracts.Rounds: [PlainRounds, SpeculativeRounds],
}


def _members(protocol) -> dict[str, object]:
    """The methods and properties a Protocol names (its bases' too), by name."""
    out = {}
    for klass in reversed(protocol.__mro__):
        if klass.__module__ == contracts.__name__:  # (FlatPrefill: Backend's members too)
            for name, value in vars(klass).items():
                if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    out[name] = value
    return out


def _shape(fn) -> list[tuple[str, object, object]]:
    """A function's parameters as (name, kind, default), annotations left out."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


CASES = [(protocol, impl) for protocol, impls in IMPLEMENTATIONS.items() for impl in impls]


@pytest.mark.parametrize("protocol, impl", CASES, ids=[f"{p.__name__}-{i.__name__}" for p, i in CASES])
def test_each_implementation_has_the_protocols_methods_with_its_signatures(protocol, impl):
    members = _members(protocol)
    assert members, protocol
    for name, member in members.items():
        found = inspect.getattr_static(impl, name, None)
        assert found is not None, f"{impl.__name__} has no {name} ({protocol.__name__})"
        if isinstance(member, property):
            assert isinstance(found, property), f"{impl.__name__}.{name} is not a property"
            continue
        assert _shape(getattr(impl, name)) == _shape(member), \
            f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))} is not {protocol.__name__}.{name}" \
            f"{inspect.signature(member)}"


def test_the_protocols_are_runtime_checkable_and_the_objects_satisfy_them():
    model = build_model(load_config(overrides=["--model.layers=2"]).model, seed=0).eval()
    cache = KVCache.for_model(model, 2, 16)
    assert isinstance(cache, contracts.Cache) and isinstance(cache.rows(0, 1), contracts.Cache)
    assert isinstance(cache.layer(0), contracts.CacheLayer)
    assert isinstance(LOCAL, contracts.Backend) and isinstance(LOCAL, contracts.FlatPrefill)
    drafter = ModelDrafter(model, 16)
    assert isinstance(drafter, contracts.Drafter)
    assert isinstance(PlainRounds(model, GREEDY), contracts.Rounds)
    for cape in (None, CapeTable.parse("0.5:1,1:0")):
        assert isinstance(SpeculativeRounds(model, drafter, 3, GREEDY, None, cape=cape), contracts.Rounds)
    # what is not one: a cache without truncate, a backend without prefill
    assert not isinstance(object(), contracts.Cache)
    assert not isinstance(torch.nn.Linear(2, 2), contracts.Backend)


def test_the_loop_and_the_round_name_no_concrete_cache_backend_or_drafter():
    """generate/loop.py and generate/speculative.py's round reach caches, backends and drafters only
    through the contracts (speculative.py names LOCAL as a default and drafter_for for the command)."""
    root = Path(__file__).resolve().parents[2] / "src" / "longctx" / "generate"
    concrete = {"KVCache", "ShardedKVCache", "LocalGeneration", "ShardedGeneration", "ModelDrafter", "GlideDrafter"}
    for name in ("loop.py", "speculative.py", "cape.py"):
        tree = ast.parse((root / name).read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not used & concrete, (name, used & concrete)
