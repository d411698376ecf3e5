"""Inductor's C++ wrapper (``torch.compile(options={"cpp_wrapper": True})``) and AOTInductor
(``aoti_compile_and_package`` of an exported scan) against the Python loop.

On torch 2.9 both used to fail to compile (the C++ wrapper's while_loop lost the carries the body
writes in place, then its memory planner indexed the wrong graph); AOTInductor on torch 2.14 failed
at run time (the buffer pool's operator got None for its empty symbol list). The C++ wrapper does
not call back into Python for the ys buffers (no pool there)."""
import copy

import pytest
import torch
from conftest import assert_trees_close
from decoder import make_stack, run_loop

from torch_scan_hop import scan, scan_layers, stack_layers

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
CPP = {"cpp_wrapper": True}


def problem(n, gen):
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return rand(3, 4), rand(n, 3, 4), rand(4, 4)


def step(w):
    def body(c, x):
        h = torch.tanh(c @ w + x)
        return h, (h * w.sum(), c.sum(-1))
    return body


def loop(c, xs, w, reverse):
    body, ys = step(w), []
    for i in (reversed(range(xs.shape[0])) if reverse else range(xs.shape[0])):
        c, y = body(c, xs[i])
        ys.append(y)
    ys = ys[::-1] if reverse else ys
    return c, tuple(torch.stack(t) for t in zip(*ys))


def loss_and_grads(out, inputs):
    c, (y0, y1) = out
    loss = c.sum() + y0.pow(2).sum() + (y1 * y1.detach()).sum()
    return [loss, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("reverse,unroll,dynamic", [(False, 1, False), (True, 2, False), (True, 1, True)])
def test_training_step_under_the_cpp_wrapper_matches_the_loop(reverse, unroll, dynamic):
    compiled = torch.compile(lambda c, xs, w: scan(step(w), c, xs, reverse=reverse, unroll=unroll),
                             options=CPP, dynamic=dynamic, fullgraph=True)
    gen = torch.Generator().manual_seed(unroll)
    for n in (5, 7):
        c, xs, w = problem(n, gen)
        got = loss_and_grads(compiled(c, xs, w), (c, xs, w))
        assert_trees_close(got, loss_and_grads(loop(c, xs, w, reverse), (c, xs, w)))


@pytest.mark.parametrize("stacked", [False, True])
def test_scan_layers_training_step_under_the_cpp_wrapper(stacked):
    base = make_stack(3, 32, 4)
    x = torch.randn(2, 8, 32)
    layers = stack_layers(copy.deepcopy(base)) if stacked else copy.deepcopy(base)
    out = torch.compile(lambda l, x: scan_layers(l, x), options=CPP)(layers, x)
    out.pow(2).mean().backward()
    ref = run_loop(base, x)
    ref.pow(2).mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(layers.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


class Rnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, c, xs):
        return scan(lambda c, x: (torch.tanh(c @ self.w + x), c.sum(-1)), c, xs, reverse=True)


def test_aot_inductor_package_runs_the_exported_scan(tmp_path):
    model, c, xs = Rnn(), torch.randn(3, 4), torch.randn(5, 3, 4)
    ep = torch.export.export(model, (c, xs))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "rnn.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for _ in range(2):  # the second call reuses the runner's buffers
        c, xs = torch.randn(3, 4), torch.randn(5, 3, 4)
        assert_trees_close(tuple(runner(c, xs)), tuple(model(c, xs)))
