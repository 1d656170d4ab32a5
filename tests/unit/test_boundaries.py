"""The module boundaries of docs/architecture.md (the floors), checked on the source: an import graph and a grep.

- models/ knows nothing about parallelism (never imports parallel/);
- planner/ predicts, it does not depend on the training loop (never imports train/trainer.py or train/setup.py;
  its validation measures a real step with train/step.py);
- config (parsing and rules) sits below everything: it imports nothing of longctx but errors;
- only parallel/comm.py calls torch.distributed collectives and point-to-point operations (so the
  byte counters see every transfer); process groups are created and torn down only in
  parallel/launch.py, parallel/spawn.py and parallel/comm.py.

Each rule is also run against a copy of the tree with one violation planted, so the check itself
is shown to catch what it is for.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "longctx"

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "P2POp", "barrier", "monitored_barrier", "send_object_list", "recv_object_list",
}
GROUP_LIFECYCLE = {"init_process_group", "new_group", "new_subgroups", "destroy_process_group"}
COMM_MODULE = "longctx.parallel.comm"
GROUP_MODULES = {"longctx.parallel.launch", "longctx.parallel.spawn", COMM_MODULE}
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}

# (importing module prefix, forbidden imported module prefixes, why)
IMPORT_RULES = [
    ("longctx.models", ("longctx.parallel",), "models are written for one device"),
    ("longctx.planner", ("longctx.train.trainer", "longctx.train.setup"),
     "the planner does not depend on the training loop"),
    ("longctx.config", ("longctx.",), "config sits below every other module"),
]
# (checkpoint.paths is pure path logic: model.init_from = DIR reads a checkpoint's [model] at config time)
CONFIG_ALLOWED = ("longctx.errors", "longctx.config", "longctx.checkpoint.paths")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path) -> set[str]:
    """Absolute names of every module `path` imports, including `from .x import y` resolved (and x.y)."""
    name = _module_name(root, path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def import_violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(root, path)
        for prefix, forbidden, why in IMPORT_RULES:
            if not (name == prefix or name.startswith((prefix + ".", prefix + "_"))):
                continue
            for imported in _imports(root, path):
                if prefix == "longctx.config" and imported.startswith(CONFIG_ALLOWED):
                    continue
                if any(imported == f.rstrip(".") or imported.startswith(f if f.endswith(".") else f + ".")
                       for f in forbidden):
                    found.append(f"{name} imports {imported} ({why})")
    return found


def _dist_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed in this module, and {local name: op} imported from it directly."""
    modules, direct = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES and not node.level:
            direct.update({a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES | GROUP_LIFECYCLE})
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and not node.level:
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return modules, direct


def _called_name(func: ast.AST, modules: set[str]) -> str | None:
    """`dist.all_reduce` / `torch.distributed.all_reduce` -> 'all_reduce'; None for anything else."""
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    if isinstance(owner, ast.Name) and owner.id in modules:
        return func.attr
    text = ast.unparse(owner)
    if text in DIST_MODULES:
        return func.attr
    return None


def comm_violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(root, path)
        tree = ast.parse(path.read_text())
        modules, direct = _dist_aliases(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            op = _called_name(node.func, modules)
            if op is None and isinstance(node.func, ast.Name) and node.func.id in direct:
                op = direct[node.func.id]
            if op in COLLECTIVES and name != COMM_MODULE:
                found.append(f"{name}:{node.lineno} calls torch.distributed.{op} (only parallel/comm.py may)")
            elif op in GROUP_LIFECYCLE and name not in GROUP_MODULES:
                found.append(f"{name}:{node.lineno} calls torch.distributed.{op} (process groups belong to "
                             f"parallel/launch.py, spawn.py or comm.py)")
    return found


def test_imports_keep_the_boundaries():
    assert import_violations(SRC) == []


def test_only_comm_calls_collectives():
    assert comm_violations(SRC) == []


@pytest.mark.parametrize("file,line,expected", [
    ("planner/cost.py", "from ..train.trainer import Trainer", "longctx.planner.cost imports longctx.train"),
    ("planner/search.py", "import longctx.train.setup", "longctx.planner.search imports longctx.train.setup"),
    ("config/load.py", "from ..memory.policies import check_policy", "longctx.config.load imports longctx.memory"),
    ("config/rules.py", "from ..parallel import dims", "longctx.config.rules imports longctx.parallel"),
    ("models/llama.py", "from ..parallel.comm import all_reduce", "longctx.models.llama imports longctx.parallel"),
])
def test_a_planted_forbidden_import_is_caught(tmp_path, file, line, expected):
    root = tmp_path / "longctx"
    shutil.copytree(SRC, root)
    path = root / file
    path.write_text(path.read_text() + f"\n{line}\n")
    assert any(v.startswith(expected) for v in import_violations(root)), import_violations(root)


@pytest.mark.parametrize("line", [
    "import torch.distributed as dist\ndist.all_reduce(None)",
    "import torch\ntorch.distributed.barrier()",
    "from torch.distributed import broadcast_object_list as bol\nbol([None])",
    "import torch.distributed as d\nd.new_group(backend='gloo')",
])
def test_a_planted_collective_is_caught(tmp_path, line):
    root = tmp_path / "longctx"
    shutil.copytree(SRC, root)
    path = root / "checkpoint" / "manager.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    " + line.replace("\n", "\n    ") + "\n")
    assert any(v.startswith("longctx.checkpoint.manager:") for v in comm_violations(root)), comm_violations(root)
