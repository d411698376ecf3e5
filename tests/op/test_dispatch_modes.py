"""Scan under dispatch modes that trace nothing, and under activation checkpointing.

A for loop runs under any TorchDispatchMode (a logging mode, FlopCounterMode,
selective checkpointing's caching modes): each op passes through the mode. So does
scan on real tensors: the modes see the body's ops, values and gradients are the
loop's. Compiled, a checkpointed region holding a scan is one scan node that the
region's policy saves or recomputes; its numbers are still the loop's.
"""
import copy
import functools

import pytest
import torch
from conftest import assert_trees_close, reference_scan
from decoder import run_loop
from test_stack_layers_random import Block
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from torch_scan_hop import scan, scan_layers, stack_layers
from torch_scan_hop.op.hop import scan_op


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def problem(dtype=torch.float64):
    W = torch.randn(5, 5, dtype=dtype, requires_grad=True)
    c0 = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    xs = torch.randn(4, 3, 5, dtype=dtype)

    def body(c, x):
        h = torch.tanh(c @ W + x)
        return h, h.sin()

    return body, c0, xs, W


def loss(out):
    carry, ys = out
    return carry.sum() + ys.pow(2).sum()


@pytest.mark.parametrize("grad_mode", ["enable_grad", "no_grad", "inference_mode"])
def test_a_logging_mode_sees_each_body_op_as_in_the_loop(grad_mode):
    body, c0, xs, W = problem()
    ctx = getattr(torch, grad_mode)
    logs = OpLog(), OpLog()
    with ctx(), logs[0]:
        got = scan(body, c0, xs)
    with ctx(), logs[1]:
        want = reference_scan(body, c0, xs)
    assert_trees_close(got, want)
    # each body op once per step in both (slicing and stacking may differ); inference mode
    # skips autograd's decomposition of matmul
    mm = torch.ops.aten.matmul.default if grad_mode == "inference_mode" else torch.ops.aten.mm.default
    for op in (mm, torch.ops.aten.tanh.default, torch.ops.aten.sin.default):
        assert logs[0].ops.count(op) == logs[1].ops.count(op) == 4, op


def test_flop_counter_counts_the_loops_flops_forward_and_backward():
    body, c0, xs, W = problem(torch.float32)
    counters = FlopCounterMode(display=False), FlopCounterMode(display=False)
    grads = []
    for counter, run in zip(counters, (scan, reference_scan)):
        with counter:
            out = run(body, c0, xs)
            grads.append(torch.autograd.grad(loss(out), (c0, W)))
    assert counters[0].get_total_flops() == counters[1].get_total_flops() == 3 * 4 * 2 * 3 * 5 * 5
    assert_trees_close(grads[0], grads[1])


def test_the_op_itself_runs_as_the_loop_under_a_mode_whatever_its_remat():
    """torch.ops.higher_order.scan called directly, with a partition function for remat."""
    from functorch.compile import default_partition

    body, c0, xs, W = problem()

    def flat_body(c, x, w):
        h = torch.tanh(c @ w + x)
        return [h, h.sin()]

    with OpLog() as log:
        out = scan_op(flat_body, [c0], [xs], (W,), remat=default_partition)
        g = torch.autograd.grad(out[0].sum() + out[1].pow(2).sum(), (c0, W))
    assert log.ops.count(torch.ops.aten.mm.default) >= 4
    want = reference_scan(body, c0, xs)
    assert_trees_close(out, list(want))
    assert_trees_close(g, torch.autograd.grad(loss(want), (c0, W)))


def save_matmuls():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


CHECKPOINTS = {
    "plain": dict(use_reentrant=False),
    "selective": dict(use_reentrant=False, context_fn=save_matmuls),
}


def checkpointed(run, how, xs):
    def f(c, w):
        def inner(c):
            def step(h, x):
                h = torch.tanh(h @ w + x)
                return h, h.sin()

            return loss(run(step, c, xs))

        return checkpoint(inner, c, **CHECKPOINTS[how])

    return f


def test_checkpointed_scan_gradcheck():
    body, c0, xs, W = problem()
    assert torch.autograd.gradcheck(checkpointed(scan, "plain", xs), (c0, W))


@pytest.mark.parametrize("how", list(CHECKPOINTS))
def test_checkpointed_scan_matches_the_checkpointed_loop(how):
    """Selective checkpointing allows one backward per forward (gradcheck needs many)."""
    body, c0, xs, W = problem()
    got, want = checkpointed(scan, how, xs)(c0, W), checkpointed(reference_scan, how, xs)(c0, W)
    assert_trees_close((got, torch.autograd.grad(got, (c0, W))), (want, torch.autograd.grad(want, (c0, W))))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("how", list(CHECKPOINTS))
@pytest.mark.parametrize("remat", ["save_all", "min_cut", "recompute_all"])
def test_compiled_checkpointed_scan_matches_the_loop(backend, how, remat):
    """The body's joint used to inherit the region's recompute tags and fail partitioning;
    selective checkpointing used to find no rule for the scan op."""
    torch._dynamo.reset()
    body, c0, xs, W = problem()
    region = functools.partial(checkpoint, lambda c: loss(scan(body, c, xs, remat=remat)), **CHECKPOINTS[how])
    got = torch.compile(region, backend=backend, fullgraph=True)(c0)
    want = loss(reference_scan(body, c0, xs))
    assert_trees_close((got, torch.autograd.grad(got, (c0, W))), (want, torch.autograd.grad(want, (c0, W))))


@pytest.mark.parametrize("grads", ["plain", "per_layer", "stacked"])
@pytest.mark.parametrize("backend", ["none", "aot_eager", "inductor"])
@pytest.mark.parametrize("how", list(CHECKPOINTS))
def test_checkpointed_scan_layers_match_the_loop(grads, backend, how):
    torch._dynamo.reset()
    plain = torch.nn.ModuleList(Block(5, True, True) for _ in range(3)).double()
    layers = copy.deepcopy(plain)
    if grads != "plain":
        stack_layers(layers, grads=grads)
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    region = functools.partial(checkpoint, lambda h: scan_layers(layers, h), **CHECKPOINTS[how])
    fn = region if backend == "none" else torch.compile(region, backend=backend, fullgraph=True)
    got = fn(x).pow(2).sum()
    want = run_loop(plain, x).pow(2).sum()
    names = [n for n, _ in plain[0].named_parameters()]
    if grads == "stacked":
        ps = [layers.stacked_parameters()[n] for n in names]
    else:
        ps = [layer.get_parameter(n) for n in names for layer in layers]
    want_ps = [layer.get_parameter(n) for n in names for layer in plain]
    g, gw = torch.autograd.grad(got, [x, *ps]), torch.autograd.grad(want, [x, *want_ps])
    if grads == "stacked":  # one gradient per name: the loop's per-layer ones, stacked
        gw = [gw[0]] + [torch.stack(gw[1 + i * 3:4 + i * 3]) for i in range(len(names))]
    assert_trees_close((got, g), (want, tuple(gw)), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("remat", ["save_all", "min_cut", "recompute_all"])
def test_a_scan_nested_in_a_checkpointed_step_runs_as_the_loop(remat):
    """remat="min_cut" runs each eager step under selective checkpointing; a scan in the
    body used to find no rule for that mode."""
    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def inner(c, x):
        return torch.tanh(c @ W + x), c.sin()

    def outer(c, xs):
        c, ys = scan(inner, c, xs)
        return c, ys.sum(0)

    def ref_outer(c, xs):
        c, ys = reference_scan(inner, c, xs)
        return c, ys.sum(0)

    c0, X = torch.randn(2, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, 2, 4, dtype=torch.float64)
    got, want = scan(outer, c0, X, remat=remat), reference_scan(ref_outer, c0, X)
    assert_trees_close(got, want)
    assert_trees_close(torch.autograd.grad(loss(got), (c0, W)), torch.autograd.grad(loss(want), (c0, W)))
