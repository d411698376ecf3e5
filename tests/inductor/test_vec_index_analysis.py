"""Defect 9 of ``inductor/workarounds.py``: torch 2.9's C++ codegen ran ``sympy.simplify`` on every
index whose stride in the vector lane it asks (~6-10 ms for an index holding a size symbol, as a
loop body's index of xs does); a polynomial index is now returned as it is. The strides read from
it are the ones torch's own function gives, for polynomial indices and others (floor division,
modulus: still torch's)."""
import pytest
import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

import torch_scan_hop  # noqa: F401  (installs the inductor patches)
from torch_scan_hop.inductor import workarounds

cpp = pytest.importorskip("torch._inductor.codegen.cpp")
pytestmark = pytest.mark.skipif(not hasattr(cpp, "simplify_index_in_vec_range"),
                                reason="torch 2.15: sizevars' function, which runs no sympy.simplify")

x0, x1 = sympy.symbols("x0 x1", integer=True, nonnegative=True)
ks0, d0 = sympy.symbols("ks0 d0", integer=True, positive=True)
POLYNOMIAL = [x0 + 512 * ks0, 2 * (x0 + ks0) + 3, 64 * x0 + x1, x0 * ks0 + x1, x0, sympy.Integer(7), 16 * d0 + x0]
OTHERS = [FloorDiv(x0, 16) + ks0, ModularIndexing(x0, 1, 64) + 64 * ks0, FloorDiv(x0, 3) * 8 + x0]


def _torch_simplify():
    simplify = cpp.simplify_index_in_vec_range
    return simplify.__wrapped__ if getattr(simplify, "_scan_polynomial", False) else simplify


def test_installed():
    workarounds.keep_polynomial_vec_indices_unsimplified()
    assert getattr(cpp.simplify_index_in_vec_range, "_scan_polynomial", False)


@pytest.mark.parametrize("index", POLYNOMIAL)
def test_a_polynomial_index_is_returned_as_it_is(index):
    workarounds.keep_polynomial_vec_indices_unsimplified()
    assert cpp.simplify_index_in_vec_range(index, x0, 16) is index


@pytest.mark.parametrize("index", POLYNOMIAL + OTHERS)
@pytest.mark.parametrize("var", [x0, x1])
def test_strides_are_torchs(index, var):
    workarounds.keep_polynomial_vec_indices_unsimplified()
    ours = cpp.stride_at(cpp.simplify_index_in_vec_range(index, var, 16), var)
    theirs = cpp.stride_at(_torch_simplify()(index, var, 16), var)
    assert sympy.simplify(ours - theirs) == 0
