"""XLA: what a body may create or read, and inputs spread over CPU and XLA.

Tensors the body creates become constants of the While, moves to the CPU
keep the value on the device, and a host read inside the body is a ScanError
naming the op, raised before anything could abort the process. Mixed CPU/XLA
inputs run as if all were on the XLA device, gradients included.
"""
import re

import pytest
import torch
import xla_isolated_cases
from conftest import assert_trees_close, reference_scan
from xla_util import DEV, run_isolated, to_cpu, weighted_sum

from torch_scan_hop import scan


@pytest.fixture(scope="module")
def isolated_report():
    """{case name: output} from one subprocess running every case; a case
    that killed the process has the crash output and no PASS line."""
    rc, out = run_isolated("import xla_isolated_cases; xla_isolated_cases.main()", timeout=900)
    report = {}
    for block in re.split(r"(?m)^START ", out)[1:]:
        name, _, rest = block.partition("\n")
        report[name.strip()] = rest
    return rc, out, report


@pytest.mark.parametrize("name", [c.__name__ for c in xla_isolated_cases.CASES])
def test_in_a_subprocess(isolated_report, name):
    rc, out, report = isolated_report
    assert name in report, f"never reached (exit code {rc}):\n{out[-3000:]}"
    assert f"PASS {name}" in report[name], f"exit code {rc}:\n{report[name][-3000:]}"


def _leaf(shape, device, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5).to(device).requires_grad_()


def assert_mixed_matches_loops(make_body, closures, init, xs):
    """scan on inputs spread over CPU and XLA == the Python loop on CPU copies,
    values and grads; each gradient lands on its leaf's own device. (A loop on
    the mixed inputs themselves is no reference: torch_xla moves a CPU operand
    for some ops, not for matmul, and its backward hands XLA gradients to CPU
    leaves, which autograd rejects.)"""
    leaves = [*closures, init, xs]
    out = scan(make_body(*closures), init, xs)
    grads = torch.autograd.grad(weighted_sum(out), leaves, materialize_grads=True)
    assert [g.device for g in grads] == [t.device for t in leaves]
    cpu = [t.detach().cpu().requires_grad_() for t in leaves]
    want = reference_scan(make_body(*cpu[:-2]), cpu[-2], cpu[-1])
    want_grads = torch.autograd.grad(weighted_sum(want), cpu)
    assert_trees_close(to_cpu((out, grads)), (want, want_grads), atol=1e-5, rtol=1e-5)


def tanh_cell(w):
    return lambda c, x: (torch.tanh(c @ w + x), (c * w[0]).sum(-1))


def test_cpu_init_with_xla_xs():
    assert_mixed_matches_loops(tanh_cell, [_leaf((3, 3), DEV, 0)], _leaf((2, 3), "cpu", 1), _leaf((4, 2, 3), DEV, 2))


def test_xla_init_with_cpu_xs():
    assert_mixed_matches_loops(tanh_cell, [_leaf((3, 3), DEV, 0)], _leaf((2, 3), DEV, 1), _leaf((4, 2, 3), "cpu", 2))


def test_cpu_closure_read_twice_with_xla_inputs():
    assert_mixed_matches_loops(tanh_cell, [_leaf((3, 3), "cpu", 0)], _leaf((2, 3), DEV, 1), _leaf((4, 2, 3), DEV, 2))


def test_cpu_scalars_beside_xla_xs():
    """0-dim CPU tensors (which fake tracing lets mix with XLA ones): init and a closure."""
    def make_body(s):
        return lambda c, x: (c * 0.5 + x.sum() * s, c * x)
    assert_mixed_matches_loops(make_body, [_leaf((), "cpu", 0)], _leaf((), "cpu", 1), _leaf((4, 2), DEV, 2))


def test_cpu_tensor_made_in_body_meets_xla_values():
    def body(c, x):
        return c + x * torch.arange(2.0), torch.ones(2) + c
    init, xs = torch.zeros(2, device=DEV), torch.randn(4, 2).to(DEV)
    assert_trees_close(to_cpu(scan(body, init, xs)), to_cpu(reference_scan(body, init, xs)))
