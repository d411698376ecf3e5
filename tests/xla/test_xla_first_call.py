"""An eager XLA scan's first training call is traced by make_fx, its second captured by Dynamo
(xla/eager.py): the two routes must leave XLA one program per training step, reuse one plan
and keep none of the user's tensors alive past the call (a live tensor is an output of the
step's program). Values and gradients are the loop's on both routes."""
import gc
import weakref

import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import clear_cache, scan
from torch_scan_hop.op import autograd as op_autograd
from torch_scan_hop.xla import eager as xla_eager

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import torch_xla.debug.metrics as metrics  # noqa: E402

DEV = torch_xla.device()


def _compiles():
    data = metrics.metric_data("CompileTime")
    return data[0] if data else 0


def _step(w, h0, xs, device):
    """One training step shaped like scan_model's: the weights the body reads are made anew each
    step (scan_model stacks its layers' weights so), and the body closes over its own init and
    detaches it without reading the result (a decoder layer's dead ``hidden.detach()``)."""
    w.grad = None
    stacked = w * 1.0
    init = h0.to(device) * 1.0

    def body(c, x):
        init.detach()
        c = torch.tanh(c @ stacked + x)
        return c, c.sum(-1)

    c, ys = (scan if device == DEV else reference_scan)(body, init, xs.to(device))
    loss = c.pow(2).sum() + ys.sin().sum()
    loss.backward()
    if device == DEV:
        torch_xla.sync()  # the step's one program: compiled on its first run, reused after
    return [t.detach().cpu() for t in (loss, c, ys, w.grad)]


def test_a_training_step_is_compiled_once_across_the_two_routes():
    clear_cache()
    gen = torch.Generator().manual_seed(0)
    w_cpu, h0, xs = torch.randn(7, 7, generator=gen) * 0.3, torch.randn(3, 7, generator=gen), torch.randn(6, 3, 7, generator=gen)
    w = w_cpu.to(DEV).requires_grad_()
    want = _step(w_cpu.clone().requires_grad_(), h0, xs, "cpu")
    compiled = []
    gc.collect()
    gc.disable()  # what only Python's gc would free stays alive, as when it has not run yet
    try:
        for call in range(3):
            before = _compiles()
            got = _step(w, h0, xs, DEV)
            compiled.append(_compiles() - before)
            assert_trees_close(got, want, atol=1e-5, rtol=1e-5)
            assert len(xla_eager._entries) == (call > 0)  # traced by make_fx first, then captured
    finally:
        gc.enable()
    assert compiled[0] > 0 and compiled[1:] == [0, 0], compiled


def test_the_capture_after_a_traced_first_call_reuses_its_plan(monkeypatch):
    """The second call's graph is Dynamo's, not make_fx's: its plan is found by the joint."""
    clear_cache()
    partitions = [0]
    real = op_autograd.partition_step

    def counting(*args, **kwargs):
        partitions[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(op_autograd, "partition_step", counting)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(5, 5, generator=gen) * 0.3).to(DEV).requires_grad_()
    init, xs = torch.randn(2, 5, generator=gen).to(DEV), torch.randn(4, 2, 5, generator=gen).to(DEV)
    for call in range(3):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), init, xs)
        (c.sum() + ys.sum()).backward()
        assert partitions[0] == 1, (call, partitions[0])
    assert len(xla_eager._entries) == 1


def test_a_first_call_keeps_no_closure_alive_without_gc():
    """The make_fx route's graphs and tracer sit in reference cycles; the user's tensors they held
    as constants lived until Python's gc ran, and were outputs of the step's program."""
    clear_cache()
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(4, 4, generator=gen) * 0.3).to(DEV).requires_grad_()
    init, xs = torch.randn(2, 4, generator=gen).to(DEV), torch.randn(3, 2, 4, generator=gen).to(DEV)
    gc.collect()
    gc.disable()
    try:
        stacked = w * 2.0
        alive = weakref.ref(stacked)
        c, ys = scan(lambda c, x: (torch.tanh(c @ stacked + x), None), init, xs)
        c.sum().backward()
        assert not xla_eager._entries  # the make_fx route
        del stacked, c, ys
        outlived = alive() is not None
        assert not outlived
    finally:
        gc.enable()
