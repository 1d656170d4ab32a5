"""The module boundaries of docs/architecture.md (the floors), checked on the source: an import graph and a grep.

- the floors: every import (at the top, inside a function, under TYPE_CHECKING alike) goes to the
  importer's own floor or one below, never up; packages that share a floor do not import each other;
  and no two modules import each other, directly or round a loop;
- the job floor (job/: launch, spawn, process groups, comm, dims, checks, watchdog, devices) imports
  none of train / planner / generate / bench / eval;
- models/ knows nothing about parallelism (never imports parallel/);
- planner/ predicts, it does not depend on the training loop (never imports train/; its validation
  measures a real step through step/, below both);
- config (parsing and rules) sits below everything: it imports nothing of longctx but errors;
- only job/comm.py calls torch.distributed collectives and point-to-point operations (so the
  byte counters see every transfer); process groups are created and torn down only in
  job/launch.py, job/spawn.py and job/comm.py.

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
COMM_MODULE = "longctx.job.comm"
GROUP_MODULES = {"longctx.job.launch", "longctx.job.spawn", COMM_MODULE}
DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}

# (importing module prefix, forbidden imported module prefixes, why)
IMPORT_RULES = [
    ("longctx.job", ("longctx.train", "longctx.planner", "longctx.generate", "longctx.bench", "longctx.eval"),
     "the job floor sits below everything that runs on it"),
    ("longctx.models", ("longctx.parallel",), "models are written for one device"),
    ("longctx.planner", ("longctx.train",), "the planner does not depend on the training loop"),
    ("longctx.config", ("longctx.",), "config sits below every other module"),
]
CONFIG_ALLOWED = ("longctx.errors", "longctx.config")

# docs/architecture.md's floors, lowest first: the top-level modules and packages of each
FLOORS = [
    {"longctx", "errors"},
    {"progress", "cache_dir", "threads", "faults", "durable", "strict_json", "env_vars"},
    {"config"},
    {"job"},
    {"ops"},
    {"models"},
    {"data", "memory"},
    {"costs", "step", "checkpoint"},
    {"parallel"},
    {"train", "planner", "generate"},
    {"eval"},
    {"bench"},
    {"cli"},
    {"__main__"},
]
FLOOR_OF = {top: i for i, tops in enumerate(FLOORS) for top in tops}


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


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _graph(root: Path) -> dict[str, set[str]]:
    """{module: the longctx modules it imports} (a `from pkg import name` counts as pkg.name when
    that is a module, as pkg otherwise)."""
    modules = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(root, path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def floor_violations(root: Path) -> list[str]:
    """Imports that climb a floor or cross to another package of the same floor, and modules of no floor."""
    found = []
    for name, targets in sorted(_graph(root).items()):
        top = _top(name)
        if top not in FLOOR_OF:
            found.append(f"{name} is on no floor (add its package to FLOORS and docs/architecture.md)")
            continue
        for target in sorted(targets):
            there = _top(target)
            if FLOOR_OF.get(there, -1) > FLOOR_OF[top]:
                found.append(f"{name} imports {target}: climbs from floor {FLOOR_OF[top]} to {FLOOR_OF[there]}")
            elif there != top and FLOOR_OF.get(there) == FLOOR_OF[top] and "longctx" not in (top, there):
                found.append(f"{name} imports {target}: across floor {FLOOR_OF[top]} ({top} -> {there})")
    return found


def import_cycles(root: Path) -> list[list[str]]:
    """Every set of modules that import each other round a loop (strongly connected components)."""
    graph, index, low, stack, on_stack, cycles = _graph(root), {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                cycles.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


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
                found.append(f"{name}:{node.lineno} calls torch.distributed.{op} (only job/comm.py may)")
            elif op in GROUP_LIFECYCLE and name not in GROUP_MODULES:
                found.append(f"{name}:{node.lineno} calls torch.distributed.{op} (process groups belong to "
                             f"job/launch.py, spawn.py or comm.py)")
    return found


def test_imports_keep_the_boundaries():
    assert import_violations(SRC) == []


def test_every_import_stays_on_its_floor_or_goes_down():
    assert floor_violations(SRC) == []


def test_no_modules_import_each_other():
    assert import_cycles(SRC) == []


@pytest.mark.parametrize("file,line,expected", [
    ("job/comm.py", "    from ..train.trainer import Trainer", "longctx.job.comm imports longctx.train.trainer"),
    ("config/rules.py", "from ..job import dims", "longctx.config.rules imports longctx.job.dims: climbs"),
    ("planner/search.py", "from ..generate.results import Result", "longctx.planner.search imports longctx.generate"),
])
def test_a_planted_climb_is_caught(tmp_path, file, line, expected):
    root = tmp_path / "longctx"
    shutil.copytree(SRC, root)
    path = root / file
    text = path.read_text()
    if line.startswith("    "):  # an import inside a function counts as much as one at the top
        line = "def _planted():\n" + line
    path.write_text(text + f"\n\n{line}\n")
    assert any(v.startswith(expected) for v in floor_violations(root)), floor_violations(root)


def test_a_planted_circle_is_caught(tmp_path):
    """ops/loss.py imports norm.py; norm.py importing loss.py back, inside a function, closes a circle
    (no climb: both are on one floor, in one package)."""
    root = tmp_path / "longctx"
    shutil.copytree(SRC, root)
    path = root / "ops" / "norm.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    from .loss import lm_head_loss  # noqa\n")
    assert ["longctx.ops.loss", "longctx.ops.norm"] in import_cycles(root), import_cycles(root)
    assert floor_violations(root) == []


def test_only_comm_calls_collectives():
    assert comm_violations(SRC) == []


@pytest.mark.parametrize("file,line,expected", [
    ("planner/cost.py", "from ..train.trainer import Trainer", "longctx.planner.cost imports longctx.train"),
    ("planner/search.py", "import longctx.train.setup", "longctx.planner.search imports longctx.train.setup"),
    ("config/load.py", "from ..memory.apply_policy import check_policy", "longctx.config.load imports longctx.memory"),
    ("config/rules.py", "from ..job import dims", "longctx.config.rules imports longctx.job"),
    ("models/llama.py", "from ..parallel.context import ring", "longctx.models.llama imports longctx.parallel"),
    ("job/launch.py", "from ..bench.moe import main", "longctx.job.launch imports longctx.bench"),
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
