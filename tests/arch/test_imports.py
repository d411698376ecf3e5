"""The package's folders are its architecture: imports run one way, down the floors, with no cycle.

Every import statement counts, function-level ones included (a cycle hidden in a function is
still a cycle: the two modules cannot be understood, tested or moved apart). Floors, top down:

    demo.py               a user program: python -m torch_scan_hop.demo
    __init__.py           the package face
    models/               whole models (scan_model), built on layers
    fwd_bwd.py, layers/   front ends built on scan
    api.py                scan's front end
    op/                   the HigherOrderOperator and its rules
    xla/                  the XLA While (uses trace/)
    trace/, inductor/     tracing and partitioning; inductor lowering
    remat/                what a step keeps for its backward: policies, eager engine, partitioning
    core/                 pytrees and errors, the schedule, the op's arguments
    _compat/              private torch / torch_xla APIs, importing nothing of ours

A module may import its own folder's modules and any lower floor; never a higher floor or a
sibling folder on the same floor.
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torch_scan_hop"  # tests/arch/ -> the repository
NAME = PACKAGE.name

FLOORS = {
    "_compat": 0,
    "_hlo_scan": 0,  # the C++ extension (csrc/), imports nothing
    "core": 1,
    "remat": 1.5,  # policies, the eager engine, partition functions: above core, below trace
    "trace": 2,
    "inductor": 2,
    "xla": 3,
    "op": 4,
    "api": 5,
    "fwd_bwd": 6,
    "layers": 6,
    "models": 7,  # scan_model: whole models, built on layers
    "": 8,  # torch_scan_hop/__init__.py, the package face
    "demo": 9,  # a user program of the package
}
RULE_HELPERS = {"__init__", "hop", "loop", "compile_errors", "carry_grads"}  # op/ modules that are not dispatch rules


def _modules():
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_package)
    mods["_hlo_scan"] = (None, False)
    return mods


def _imported(module, is_package, node, mods):
    """The package modules (dotted, relative to the package) an import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name == NAME or a.name.startswith(NAME + ".")]
        return [n[len(NAME) + 1:] if n != NAME else "" for n in names]
    if node.level:
        base = module.split(".") if module else []
        if not is_package:
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        base = ".".join(base + ([node.module] if node.module else []))
    elif node.module == NAME or (node.module or "").startswith(NAME + "."):
        base = node.module[len(NAME) + 1:]
    else:
        return []
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}" if base else alias.name
        out.append(full if full in mods else base)
    return out


def import_graph():
    mods = _modules()
    graph = {}
    for module, (path, is_package) in mods.items():
        deps = set()
        if path is not None:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    deps.update(d for d in _imported(module, is_package, node, mods) if d != module)
        graph[module] = deps
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _room(module):
    return module.split(".")[0]


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_folder_and_module_has_a_floor():
    assert {_room(m) for m in import_graph()} <= set(FLOORS)


def test_imports_run_down_the_floors():
    wrong = []
    for module, deps in import_graph().items():
        room = _room(module)
        for dep in deps:
            if _room(dep) != room and FLOORS[_room(dep)] >= FLOORS[room]:
                wrong.append(f"{module or NAME} imports {dep or NAME}")
    assert wrong == []


def test_compat_imports_nothing_of_ours():
    graph = import_graph()
    assert [(m, d) for m in graph if _room(m) == "_compat" for d in graph[m] if _room(d) != "_compat"] == []


def test_rules_import_no_other_rule():
    """Each rule module of op/ stands alone: shared code lives in ``hop``, ``loop`` or below."""
    graph = import_graph()
    rules = {m for m in graph if m.startswith("op.") and m.split(".")[1] not in RULE_HELPERS}
    assert len(rules) >= 8
    assert [(m, d) for m in rules for d in graph[m] if d in rules] == []


def test_rules_are_listed_in_one_place():
    from torch_scan_hop import op

    listed = {m.__name__.rsplit(".", 1)[1] for m in op.RULES.values()}
    assert listed == {p.stem for p in (PACKAGE / "op").glob("*.py")} - RULE_HELPERS


def test_each_folder_says_what_it_holds_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init.parent.name}/__init__.py needs a docstring saying what the folder holds"
        assert "import" in doc, f"{init.parent.name}/__init__.py should say what the folder may import"


# Modules missing from the docstring of a folder another engineer is reorganizing now (issue 61):
# listed there with that change. Remove an entry once it is listed; the test fails on one that is.
UNLISTED_FOR_NOW = {
    "inductor": {"body_passes", "counter", "host_rows"},
}


def _unlisted_modules():
    """``{folder: {modules}}`` whose name (``name`` in double backquotes) the folder's
    ``__init__`` docstring does not mention."""
    out = {}
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__" and f"``{p.stem}``" not in doc}
        if missing:
            out[init.parent.name] = missing
    return out


def test_each_folder_lists_its_modules():
    """A folder's ``__init__`` docstring is its table of contents: a module missing there is a
    module a reader of the folder does not know is there."""
    unlisted = _unlisted_modules()
    assert {f: sorted(m - UNLISTED_FOR_NOW.get(f, set())) for f, m in unlisted.items()
            if m - UNLISTED_FOR_NOW.get(f, set())} == {}
    listed_now = sorted(f"{f}/{m}" for f, mods in UNLISTED_FOR_NOW.items() for m in mods
                        if (PACKAGE / f / f"{m}.py").exists() and m not in unlisted.get(f, set()))
    assert listed_now == [], "these are listed now: drop them from UNLISTED_FOR_NOW"


def _definitions():
    """``{name: {module paths}}`` of every top-level def, class and assignment, and of every custom op."""
    defs, ops = {}, {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            for name in names:
                defs.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
            for deco in getattr(node, "decorator_list", ()):  # torch.library.custom_op("ns::name", ...)
                if isinstance(deco, ast.Call) and deco.args and isinstance(deco.args[0], ast.Constant) \
                        and "::" in str(deco.args[0].value):
                    ops.setdefault(deco.args[0].value.split("::")[-1], set()).add(str(path.relative_to(PACKAGE)))
    return defs, ops


def test_no_two_public_things_share_a_name():
    """Each public name (the package's ``__all__``) is defined once, and no operator the package
    registers is named like a function or class of another module (an operator
    ``torch_scan_hop::stack_layers`` beside the public ``stack_layers`` read as one thing in
    graphs and error messages)."""
    import torch_scan_hop

    defs, ops = _definitions()
    assert {n: sorted(defs.get(n, ())) for n in torch_scan_hop.__all__ if len(defs.get(n, ())) != 1} == {}
    assert sorted(n for n in ops if defs.get(n, set()) - ops[n]) == []  # the op of a function beside it is fine
    assert ops, "the custom-op scan above found no operator: the test reads nothing"


def test_modules_stay_small_and_the_readme_is_a_users_document():
    """Depth goes to docs/ and big modules are split: a module over 450 lines or a README over
    16,000 characters is where the house starts to sprawl."""
    big = [f"{p.relative_to(PACKAGE)} ({n} lines)" for p in sorted(PACKAGE.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > 450]
    assert not big, f"split these modules: {big}"
    readme = len((PACKAGE.parent / "README.md").read_text())
    assert readme <= 16000, f"README.md has {readme} characters; move depth into docs/ (limit 16,000)"
