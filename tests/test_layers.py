"""The package's imports run one way, layer by layer, and form no cycle.

Every ``import`` of a tether module counts: at module level, under ``TYPE_CHECKING``
and inside functions (a function-level import is how a cycle hides). Layers, bottom
first: foundations (errors, payloads, policies, history), definitions, the store,
the workflow side (deterministic), the worker, the client (App), the services (CLI,
store migration, the package's public face). A module may import its own layer or a
lower one. Only ``store.ops`` may cycle within itself (its operations call across
concerns; see its docstring).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import parse_quietly

SRC = Path(__file__).parent.parent / "src" / "tether"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        (
            "tether._errors",
            "tether._serde",
            "tether._policy",
            "tether._history",
            "tether._paging",
            "tether._classify",
            "tether._breaker",
            "tether._queues",
            "tether._batching",
            "tether._usage",
            "tether.webhooks",
            "tether._switches",
            "tether._tracing",
            "tether._telemetry",
            "tether._redact",
            "tether._alert_rules",
            "tether._schedules",
            "tether._periodic",
            "tether.blobs",
            "tether.encryption",
            "tether._codec",
        ),
    ),
    ("definitions", ("tether._definitions",)),
    ("store", ("tether.store",)),
    ("workflow", ("tether.workflow",)),
    (
        "worker",
        (
            "tether._activity_context",
            "tether._blob_api",
            "tether._attempts",
            "tether._host",
            "tether._batch",
            "tether._batch_run",
            "tether._worker",
        ),
    ),
    (
        "client",
        (
            "tether._update_wait",
            "tether._app",
            "tether._sync",
            "tether.testing",
            "tether._entities",
        ),
    ),
    ("ai", ("tether.ai",)),
    (
        "services",
        (
            "tether.cli",
            "tether.server",
            "tether.store.migrate",
            "tether.metrics",
            "tether.logs",
            "tether.alerts",
            "tether.demo",
            "tether",
        ),
    ),
]
#: packages whose modules may import each other in a cycle
CYCLES_ALLOWED = ("tether.store.ops",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return rank


def _imports(path: Path, module: str) -> set[str]:
    """Every tether module ``module`` imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(parse_quietly(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "tether"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tether":
                continue
            out.add(target)
            for alias in node.names:  # ``from . import runs`` names a module
                candidate = f"{target}.{alias.name}"
                if (SRC.parent / candidate.replace(".", "/")).with_suffix(".py").exists():
                    out.add(candidate)
    out.discard(module)
    return out


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, _module_name(p)) for p in sorted(SRC.rglob("*.py"))}


def test_every_import_points_to_its_own_layer_or_below() -> None:
    wrong = [
        f"{mod} ({LAYERS[_layer(mod)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
        for mod, deps in _graph().items()
        for dep in sorted(deps)
        if _layer(dep) > _layer(mod)
    ]
    assert wrong == [], "imports that go up a layer:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    bad = [
        c for c in cycles if not all(any(m.startswith(p + ".") for p in CYCLES_ALLOWED) for m in c)
    ]
    assert bad == [], f"import cycles: {bad}"


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("_worker.py", "from ._app import App\n"),
        ("_definitions.py", "from .workflow._instance import WorkflowInstance\n"),
        ("_batch.py", "from ._worker import Worker\n"),
    ],
)
def test_the_check_catches_a_reintroduced_upward_import(
    module: str, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prove the test can fail: add an old circle edge back to a copy and look again."""
    copy = tmp_path / "tether"
    import shutil

    shutil.copytree(SRC, copy)
    target = copy / module
    text = target.read_text()
    target.write_text(
        text.replace(
            "from __future__ import annotations\n",
            ("from __future__ import annotations\n\n" + f"def _late() -> None:\n    {line}"),
            1,
        )
    )
    monkeypatch.setattr(__import__(__name__), "SRC", copy)
    failures = 0
    for check in (test_every_import_points_to_its_own_layer_or_below, test_no_import_cycles):
        try:
            check()
        except AssertionError:
            failures += 1
    assert failures, f"adding `{line.strip()}` to {module} went unnoticed"
