"""Private torch / torch_xla names are used only inside torch_scan_hop/_compat/.

Every module of the package outside ``_compat/`` is read as source: its comments and docstrings are dropped, then each line is matched
against the patterns below, and its imports and ``torch.X._Y`` attribute
chains are checked on the syntax tree (which also sees imports split over
several lines and modules imported under another name). Operator names
reached through ``torch.ops`` (``aten._to_copy``) are operators, not private
Python API, and are allowed.
"""
import ast
import io
import pathlib
import re
import tokenize

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "torch_scan_hop"  # tests/arch/ -> the repository
EXEMPT = set()
ROOTS = ("torch", "torch_xla", "functorch")

_PATTERNS = [
    # torch._C, torch.utils._pytree, torch_xla._XLAC, functorch._src: a private component
    # anywhere in a dotted path from a torch root, except operators under torch.ops
    re.compile(r"\b(?:torch|torch_xla|functorch)(?:\.(?!ops\b)[A-Za-z]\w*)*\._[A-Za-z]"),
    re.compile(r"\b_XLAC\b"),
    # from torch.x import a, _private (one line; split imports are checked on the tree)
    re.compile(r"^\s*from\s+(?:torch|torch_xla|functorch)(?:\.\w+)*\s+import\s+\(?\s*"
               r"(?:\w+(?:\s+as\s+\w+)?\s*,\s*)*_[A-Za-z]"),
]


def _docstring_lines(tree):
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _code_lines(source, tree):
    """{line number: the line without its comment}, docstring lines left out."""
    lines = dict(enumerate(source.splitlines(), start=1))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row] = lines[row][:col]
    for row in _docstring_lines(tree):
        lines.pop(row, None)
    return lines


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _from_root(module):
    return module is not None and module.split(".")[0] in ROOTS


def _tree_hits(tree):
    """Lines of private imports from torch roots and of private attributes
    of names bound to torch modules."""
    hits, aliases = set(), set(ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _from_root(alias.name):
                    aliases.add(alias.asname or alias.name.split(".")[0])
                    if any(_is_private(p) for p in alias.name.split(".")):
                        hits.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _from_root(node.module):
            parts = node.module.split(".")
            for alias in node.names:
                if any(_is_private(p) for p in parts) or _is_private(alias.name):
                    hits.add(node.lineno)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        chain.reverse()
        if "ops" in chain:
            chain = chain[:chain.index("ops")]
        if any(_is_private(p) for p in chain):
            hits.add(node.lineno)
    return hits


def private_uses(path):
    """Sorted (line number, line) where the file at ``path`` uses a private torch name."""
    source = path.read_text()
    tree = ast.parse(source)
    rows = _tree_hits(tree)
    rows.update(row for row, line in _code_lines(source, tree).items() if any(p.search(line) for p in _PATTERNS))
    lines = source.splitlines()
    return [(row, lines[row - 1].strip()) for row in sorted(rows)]


def _package_files():
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if "_compat" not in p.relative_to(PACKAGE).parts[:-1] and p.name not in EXEMPT)


def test_no_private_torch_names_outside_compat():
    files = _package_files()
    assert len(files) > 10 and (PACKAGE / "_compat").is_dir()
    hits = [f"{path.relative_to(PACKAGE.parent)}:{row}: {text}"
            for path in files for row, text in private_uses(path)]
    assert not hits, "private torch / torch_xla names outside torch_scan_hop/_compat/ " \
        "(add an adapter to _compat and call it instead):\n" + "\n".join(hits)


_CAUGHT = [
    "import torch\nx = torch._C._functorch.is_batchedtensor\n",
    "import torch.utils._pytree as pytree\n",
    "from torch._ops import OpOverload\n",
    "from torch.utils import _pytree\n",
    "from torch.utils import checkpoint as ckpt, _pytree as pt\n",
    "from torch.fx.experimental.proxy_tensor import (\n    make_fx,\n    _ProxyTracer,\n)\n",
    "import torch_xla as tx\nctx = tx._XLAC.lowering\n",
    "import torch_xla\nlib = getattr(torch_xla, '_XLAC')\n",
    "def f():\n    from torch._inductor.graph import SubgraphLowering\n",
]
_ALLOWED = [
    '"""Uses torch._C through _compat."""\nimport torch\n',
    "import torch\nx = torch.ops.aten._to_copy.default  # torch._C in a comment\n",
    "import torch\nv = torch.__version__\nf = torch.fx.GraphModule\n",
    "from torch.utils import checkpoint as _ckpt\n",
    "def f(t):\n    '''t._version, torch._sync: see _compat.'''\n    return t\n",
]


@pytest.mark.parametrize("code,caught", [(c, True) for c in _CAUGHT] + [(c, False) for c in _ALLOWED])
def test_checker(tmp_path, code, caught):
    path = tmp_path / "m.py"
    path.write_text(code)
    assert bool(private_uses(path)) == caught


def test_xla_extra_pins_the_torch_its_wheel_was_built_for():
    """torch_xla's wheel does not declare its torch: without the pin, pip pairs torch_xla 2.9 with the
    newest torch the range allows, and every XLA call fails."""
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    xla = project["optional-dependencies"]["xla"]
    (xla_pin,) = [r for r in xla if r.startswith("torch_xla==")]
    assert f"torch=={xla_pin.split('==')[1]}" in xla
