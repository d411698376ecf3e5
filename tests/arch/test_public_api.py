"""The public API documents itself as JAX's ``lax.scan`` and upstream torch's scan do.

Each public function and class says what it takes (Args), gives (Returns), raises (Raises) and
shows a call (Example), and that example runs: a docstring example that no longer runs teaches
the wrong call. Signatures carry type hints, and ``py.typed`` ships them (PEP 561).
"""
import doctest
import inspect
import pathlib
import re

import pytest

import torch_scan_hop

PUBLIC = {  # name -> the sections its docstring has (a class returns nothing)
    "scan": ("Args:", "Returns:", "Raises:", "Example:"),
    "scan_layers": ("Args:", "Returns:", "Raises:", "Example:"),
    "stack_layers": ("Args:", "Returns:", "Raises:", "Example:"),
    "fwd_bwd": ("Args:", "Returns:", "Raises:", "Example:"),
    "checkpoint_name": ("Args:", "Returns:", "Raises:", "Example:"),
    "RematPolicy": ("Args:", "Raises:", "Example:"),
}
ROOT = pathlib.Path(torch_scan_hop.__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_has_its_sections(name):
    doc = inspect.getdoc(getattr(torch_scan_hop, name)) or ""
    assert [s for s in PUBLIC[name] if s not in doc] == []


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_example_runs(name):
    obj = getattr(torch_scan_hop, name)
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
    assert tests, f"{name} has no example"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if n != "RematPolicy"))
def test_signature_has_type_hints(name):
    sig = inspect.signature(getattr(torch_scan_hop, name))
    unhinted = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert unhinted == [] and sig.return_annotation is not inspect.Signature.empty


def test_scan_is_typed_as_lax_scan():
    """``fn: Callable[[Carry, X], tuple[Carry, Y]]`` and ``-> tuple[Carry, Y]``, as JAX types it."""
    hints = inspect.signature(torch_scan_hop.scan)
    assert re.fullmatch(r".*Callable\[\[~Carry, ~X\], tuple\[~Carry, ~Y\]\]", str(hints.parameters["fn"].annotation))
    assert str(hints.return_annotation) == "tuple[~Carry, ~Y]"


def test_py_typed_ships():
    assert (ROOT / "torch_scan_hop" / "py.typed").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[tool\.setuptools\.package-data\]\ntorch_scan_hop = \["py\.typed"\]', pyproject, re.M)
