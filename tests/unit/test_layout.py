"""The house holds: imports run the way tests/layout.toml allows, no module cycle, no hidden imports.

Every module under shepherd/ is read with ``ast`` (nothing is imported or executed). An import counts
wherever it stands: at the top, under ``if TYPE_CHECKING:``, inside a function. Failures name the file,
the line, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "shepherd"
RULES = ROOT / "tests" / "layout.toml"
# what an import placed inside a function says about itself (a comment on its line or just above)
REASONS = ("start-up", "optional", "not at the top")


@dataclass(frozen=True, slots=True)
class Import:
    src: str  # importing module
    dst: str  # imported module (resolved to a module or package of ours)
    path: Path
    line: int
    text: str
    in_function: bool


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module (or package) of ours that ``name`` (a module, or a module's attribute) stands for."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, mod: str, path: Path, source: str) -> None:
        self.mod = mod
        self.path = path
        self.lines = source.splitlines()
        self.is_pkg = path.name == "__init__.py"
        self.depth = 0
        self.found: list[Import] = []

    def _func(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = _func
    visit_AsyncFunctionDef = _func

    def _add(self, node: ast.Import | ast.ImportFrom, names: list[str]) -> None:
        text = self.lines[node.lineno - 1].strip()
        for n in names:
            ours = n == "shepherd" or n.startswith("shepherd.")
            dst = (_resolve(n) if ours else None) or ""  # "": not ours (stdlib, third party)
            self.found.append(Import(self.mod, dst, self.path, node.lineno, text, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        self._add(node, [a.name for a in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.mod.split(".")
            keep = len(base) - node.level + (1 if self.is_pkg else 0)
            mod = ".".join(base[:keep] + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        # ``from pkg import module`` imports the module; ``from module import name`` the module
        self._add(node, [f"{mod}.{a.name}" for a in node.names])

    def comment_near(self, line: int) -> str:
        """The comment on the import's line and the comment lines right above it."""
        out = []
        text = self.lines[line - 1]
        if "#" in text:
            out.append(text.split("#", 1)[1])
        i = line - 2
        while i >= 0 and self.lines[i].strip().startswith("#"):
            out.append(self.lines[i])
            i -= 1
        return " ".join(out)


def _collect() -> tuple[list[Import], dict[tuple[Path, int], str]]:
    imports: list[Import] = []
    comments: dict[tuple[Path, int], str] = {}
    for mod, path in MODULES.items():
        source = path.read_text(encoding="utf-8")
        c = _Collector(mod, path, source)
        c.visit(ast.parse(source, str(path)))
        imports += c.found
        for imp in c.found:
            if imp.in_function:
                comments[(path, imp.line)] = c.comment_near(imp.line)
    return imports, comments


IMPORTS, COMMENTS = _collect()
OURS = [i for i in IMPORTS if i.dst]


def _rules() -> tuple[dict[str, str], dict[str, list[str]]]:
    data = tomllib.loads(RULES.read_text(encoding="utf-8"))
    return data["parts"], data["allow"]


PARTS, ALLOW = _rules()


def part_of(mod: str) -> str:
    name = mod
    while name:
        if name in PARTS:
            return PARTS[name]
        name = name.rpartition(".")[0]
    raise KeyError(mod)


def _where(i: Import) -> str:
    return f"{i.path.relative_to(ROOT)}:{i.line}: {i.text}"


def test_every_module_has_a_part() -> None:
    missing = [m for m in MODULES if not any(m == p or m.startswith(p + ".") for p in PARTS)]
    assert not missing, f"modules outside every part of {RULES.name}: {missing}"


def test_every_part_has_a_rule() -> None:
    parts = set(PARTS.values())
    assert parts <= set(ALLOW), f"parts without an [allow] entry: {sorted(parts - set(ALLOW))}"
    named = {p for targets in ALLOW.values() for p in targets}
    assert named <= parts, f"[allow] names unknown parts: {sorted(named - parts)}"


def test_imports_run_the_way_the_layout_allows() -> None:
    bad = []
    for i in OURS:
        src, dst = part_of(i.src), part_of(i.dst)
        if src != dst and dst not in ALLOW[src]:
            may = ", ".join(ALLOW[src]) or "nothing of ours"
            bad.append(f"{_where(i)}\n    {src} -> {dst} is not allowed ({src} may import: {may})")
    assert not bad, "imports against the layout (tests/layout.toml):\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle() -> None:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in OURS:
        if i.dst != i.src:
            edges[i.src].add(i.dst)
    cycles = _cycles(edges)
    detail = []
    for comp in cycles:
        members = set(comp)
        detail += [_where(i) for i in OURS if i.src in members and i.dst in members and i.src != i.dst]
    assert not cycles, f"import cycles: {cycles}\n" + "\n".join(detail)


def test_imports_inside_functions_say_why() -> None:
    """An import inside a function is for start-up cost or an optional dependency, and says so; never to
    hide a cycle (the cycle test above counts it anyway)."""
    silent = [
        _where(i)
        for i in IMPORTS
        if i.in_function and not any(r in COMMENTS[(i.path, i.line)] for r in REASONS)
    ]
    assert not silent, "imports inside functions without a comment saying why:\n" + "\n".join(silent)


def test_every_package_states_its_job() -> None:
    bad = []
    for path in MODULES.values():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc or len(doc.split()) < 4:
            bad.append(f"{path.relative_to(ROOT)}: no docstring saying the package's job")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("src", "dst", "allowed"),
    [
        ("shepherd.proto.engine_requests", "shepherd.node.config", False),
        ("shepherd.mesh.state", "shepherd.policies.prefix_index", False),
        ("shepherd.node.engines.h2", "shepherd.node.dispatch.gateway", False),
        ("shepherd.node.dispatch.gateway", "shepherd.node.api.common", False),
        ("shepherd.mock_engine.engine", "shepherd.node.config", False),
        ("shepherd.node.api.openai", "shepherd.node.output.choice", True),
        ("shepherd.node.app", "shepherd.node.cluster.mesh_node", True),
    ],
)
def test_rules_say_what_the_layout_says(src: str, dst: str, allowed: bool) -> None:
    """The table itself: a few arrows LAYOUT forbids or allows (so a table that allows everything fails)."""
    s, d = part_of(src), part_of(dst)
    assert (s == d or d in ALLOW[s]) is allowed


def _listed(path: Path) -> list[str] | None:
    """A package's ``__all__`` (None: it has none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(v) for v in value]
    return None


def test_package_listings_match_their_modules() -> None:
    """A package whose ``__init__`` lists its modules in ``__all__`` lists each public one, and only
    modules that exist (so the listing cannot rot as modules move)."""
    bad = []
    for mod, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        listed = _listed(path)
        if listed is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
        if defined:
            continue  # a package that exports names (shepherd.parsers), not a listing of modules
        children = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == mod}
        public = {c for c in children if not c.startswith("_")}
        if set(listed) != public:
            bad.append(
                f"{path.relative_to(ROOT)}: __all__ lists {sorted(set(listed) - public)} that are not modules"
                f" and misses {sorted(public - set(listed))}"
            )
    assert not bad, "\n".join(bad)


def test_no_module_reexports_what_another_defines() -> None:
    """A name lives in one module and callers import it from there: a module's ``__all__`` lists only
    what it defines (no shim keeping an old place alive). Packages that export names (``parsers``) are
    the one exception."""
    bad = []
    for path in MODULES.values():
        if path.name == "__init__.py":
            continue
        listed = _listed(path)
        if not listed:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        ours = {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("shepherd")
            # a compiled private module (``_prefixcore``) is where the module's own definition comes from
            and not (n.module or "").rpartition(".")[2].startswith("_")
            for a in n.names
        }
        again = sorted(set(listed) & ours)
        if again:
            bad.append(f"{path.relative_to(ROOT)}: __all__ re-exports {again}")
    assert not bad, "\n".join(bad)
