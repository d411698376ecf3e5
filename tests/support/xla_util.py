"""Shared by the XLA tests: scan on XLA against the plain Python loop.

``assert_matches_loop`` runs the body as a scan on XLA and as the Python loop
(on CPU tensors, and on XLA tensors where asked) and compares outputs and the
gradients of a weighted sum of every float output with respect to every float
input (closures, init, xs).
"""
import os
import subprocess
import sys

import torch
import pytest
import torch.utils._pytree as pytree

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import _isolated  # noqa: E402
from conftest import assert_trees_close, reference_scan  # noqa: E402

from torch_scan_hop import scan  # noqa: E402

DEV = torch_xla.device()


def force_route(monkeypatch, route):
    """An eager XLA scan's route for the rest of a test: "make_fx" traces every call (the route of a
    body Dynamo cannot capture), "dynamo" is the default (a body's first call on given shapes is traced
    by make_fx, the next captured by Dynamo: ``xla/eager.py``)."""
    if route == "make_fx":
        import torch_scan_hop.xla.eager as xla_eager  # noqa: PLC0415

        monkeypatch.setattr(xla_eager, "applies", lambda *args, **kwargs: False)
    else:
        assert route == "dynamo", route


def to_cpu(tree):
    return pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def _onto(tree, device, grad):
    def move(t):
        t = t.detach().to(device)
        return t.requires_grad_(grad and t.is_floating_point())
    return pytree.tree_map(move, tree)


def weighted_sum(out):
    """Random weights per element, so that every output element matters differently."""
    gen = torch.Generator().manual_seed(1234)
    total = 0
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
            w = torch.randn(leaf.shape, generator=gen).to(leaf.device)
            total = total + (leaf.float() * w).sum()
    return total


def scan_and_loop(body, init, xs, leaves=()):
    """(scan, Python loop): outputs and the grads w.r.t. ``leaves``, inputs used as given."""
    results = []
    for out in (scan(body, init, xs), reference_scan(body, init, xs)):
        grads = torch.autograd.grad(weighted_sum(out), list(leaves), materialize_grads=True) if leaves else None
        results.append(to_cpu((out, grads)))
    return results


def run(make_body, closures, init, xs, device, *, loop, grad, **options):
    """(outputs, grads) of scan, or of the Python loop, with every tensor on ``device``."""
    closures = _onto(list(closures), device, grad)
    init, xs = _onto(init, device, grad), _onto(xs, device, grad)
    body = make_body(*closures)
    if loop:
        out = reference_scan(body, init, xs, reverse=options.get("reverse", False))
    else:
        out = scan(body, init, xs, **options)
    grads = None
    if grad:
        leaves = [t for t in (*closures, *pytree.tree_leaves(init), *pytree.tree_leaves(xs)) if t.requires_grad]
        grads = torch.autograd.grad(weighted_sum(out), leaves, allow_unused=True, materialize_grads=True)
    return to_cpu(out), to_cpu(grads)


def assert_matches_loop(make_body, closures, init, xs, *, grad=False, loops=("cpu",), atol=1e-5, rtol=1e-5,
                        **options):
    """scan on XLA == the Python loop on each device in ``loops`` ("cpu", "xla").

    The loop on XLA tensors checks XLA's own numerics (bfloat16, RNG) but
    compiles an unrolled graph (slow on a CPU host); the CPU loop is cheap.
    """
    args = (make_body, closures, init, xs)
    got = run(*args, DEV, loop=False, grad=grad, **options)
    for device in loops:
        want = run(*args, DEV if device == "xla" else device, loop=True, grad=grad, **options)
        assert_trees_close(got, want, atol=atol, rtol=rtol)
    return got


def run_isolated(code, timeout=300):
    """Run ``code`` in a fresh Python: what could abort the process must not take pytest with it.
    Returns (returncode, combined output)."""
    env = dict(os.environ, PYTHONPATH=_isolated.pythonpath(),
               PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def assert_openxla_matches_eager(loss, w_cpu, c0, xs):
    """``torch.compile(loss, backend="openxla")(w, c0, xs)`` on XLA == eager ``loss`` on the CPU,
    value and gradient with respect to ``w``."""
    want = loss(w_cpu, c0, xs)
    (g_want,) = torch.autograd.grad(want, w_cpu)
    torch._dynamo.reset()
    w = w_cpu.detach().to(DEV).requires_grad_()
    got = torch.compile(loss, backend="openxla")(w, c0.to(DEV), xs.to(DEV))
    got.backward()
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.cpu(), g_want, atol=1e-5, rtol=1e-5)
