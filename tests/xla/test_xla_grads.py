"""XLA: bodies whose gradients come from torch_xla's own formulas, and dropout.

torch_xla keeps some backward formulas in autograd.Functions around custom
ops (EinsumLinear, mark_sharding_with_gradients); scan's traced body keeps only
the op, so torch_scan_hop registers the Function's formula on the op. Dropout
must use, in the backward, the mask its forward drew.
"""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import torch_xla.core.xla_model as xm  # noqa: E402
from conftest import assert_trees_close, reference_scan  # noqa: E402
from torch_xla.distributed.spmd.xla_sharding import XLAPatchedLinear  # noqa: E402
from xla_util import DEV, assert_matches_loop, run_isolated, to_cpu, weighted_sum  # noqa: E402

from torch_scan_hop import scan  # noqa: E402

INIT, XS = torch.randn(2, 4) * 0.5, torch.randn(5, 2, 4) * 0.5
W, BIAS = torch.randn(3, 4) * 0.5, torch.randn(3) * 0.1


def _linear(fn):
    """A body that projects 4 -> 3 with fn(c, w, b) and back with w.t()."""
    def make_body(w, b):
        return lambda c, x: (torch.tanh(fn(c, w, b) @ w + x), fn(c, w, b))
    return make_body


def _on_device(linear):
    """linear on XLA, F.linear (the same math) on the CPU reference loop."""
    return lambda c, w, b: linear(c, w, b) if c.device.type == "xla" else torch.nn.functional.linear(c, w, b)


@pytest.mark.parametrize("linear", [
    lambda c, w, b: XLAPatchedLinear.apply(c, w, b),
    lambda c, w, b: torch.ops.xla.einsum_linear_forward(c, w, b),
], ids=["XLAPatchedLinear", "einsum_linear_forward"])
def test_torch_xla_einsum_linear_values_and_grads(linear):
    assert_matches_loop(_linear(_on_device(linear)), [W, BIAS], INIT, XS, grad=True, atol=1e-4, rtol=1e-4)


def test_torch_xla_einsum_linear_grads_for_weights_only():
    """Only the closures require grad: the formula's needs_input_grad path."""
    w, b = W.to(DEV).requires_grad_(), BIAS.to(DEV).requires_grad_()
    make_body = _linear(lambda c, w, b: XLAPatchedLinear.apply(c, w, b))
    init, xs = INIT.to(DEV), XS.to(DEV)
    got = torch.autograd.grad(weighted_sum(scan(make_body(w, b), init, xs)), [w, b])
    wc, bc = W.clone().requires_grad_(), BIAS.clone().requires_grad_()
    want = torch.autograd.grad(weighted_sum(reference_scan(_linear(torch.nn.functional.linear)(wc, bc), INIT, XS)),
                               [wc, bc])
    assert_trees_close(to_cpu(got), want, atol=1e-4, rtol=1e-4)


_SPMD = """
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
import torch_xla.distributed.spmd as xs
from xla_util import assert_matches_loop
mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(), 1))

def make_body(w):
    def body(c, x):
        h = torch.tanh(c @ w + x)
        if h.device.type == "xla":
            h = xs.mark_sharding_with_gradients(h, mesh, (0, None))
        return h, h.sum(-1)
    return body

assert_matches_loop(make_body, [torch.randn(4, 4) * 0.5], torch.randn(2, 4), torch.randn(5, 2, 4), grad=True,
                    atol=1e-5, rtol=1e-5)
print("SPMD OK")
"""


def test_mark_sharding_with_gradients_in_an_spmd_body():
    """SPMD mode is process-wide: in a subprocess."""
    rc, out = run_isolated(_SPMD)
    assert rc == 0 and "SPMD OK" in out, out[-3000:]


class _Cube(torch.autograd.Function):
    """x ** 3 with its backward written out (3 x^2 g)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g + 1.0  # + 1: a formula that differs from differentiating forward


def test_user_autograd_function_backward_is_used():
    def make_body(w):
        return lambda c, x: (_Cube.apply(c @ w) * 0.1 + x, c.sum(-1))
    assert_matches_loop(make_body, [torch.randn(4, 4) * 0.5], INIT, XS, grad=True, atol=1e-4, rtol=1e-4)


def _check_dropout_grads(run_scan, reverse=False):
    """The mask is read off the outputs (dropped entries are exactly 0) and the
    gradient compared with the Python loop on CPU applying those masks."""
    p, n = 0.5, 7
    w0, c0, xs = torch.randn(4, 4) * 0.5, torch.randn(3, 4), torch.randn(n, 3, 4)
    w = w0.to(DEV).requires_grad_()
    xm.set_rng_state(7)
    c, ys = run_scan(w, c0.to(DEV), xs.to(DEV))
    (g,) = torch.autograd.grad(weighted_sum((c, ys)), w)
    masks = (ys.cpu() != 0).float()
    assert 0 < masks.mean() < 1

    wc = w0.clone().requires_grad_()
    step = iter(range(n - 1, -1, -1) if reverse else range(n))
    want = reference_scan(lambda c, x: (lambda d: (d, d))(torch.tanh(c @ wc + x) * masks[next(step)] / (1 - p)),
                          c0, xs, reverse=reverse)
    (g_want,) = torch.autograd.grad(weighted_sum(want), wc)
    assert_trees_close(to_cpu((c, ys, g)), (*want, g_want), atol=1e-5, rtol=1e-5)


def _dropout_scan(**options):
    def run_scan(w, c0, xs):
        def body(c, x):
            d = torch.nn.functional.dropout(torch.tanh(c @ w + x), 0.5, training=True)
            return d, d
        return scan(body, c0, xs, **options)
    return run_scan


@pytest.mark.parametrize("remat", ["save_all", "min_cut", "recompute_all"])
@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 3)])
def test_dropout_backward_uses_the_forward_mask(remat, reverse, unroll):
    _check_dropout_grads(_dropout_scan(remat=remat, reverse=reverse, unroll=unroll), reverse)


def test_dropout_under_openxla_compile_backward_uses_the_forward_mask():
    """AOT keeps native_dropout, whose bool mask torch_xla lowers as f32: the
    While converts between the body's element types and the torch dtypes."""
    torch._dynamo.reset()
    _check_dropout_grads(torch.compile(_dropout_scan(), backend="openxla"))


REDUCTIONS_OVER_EMPTY_DIM = {  # torch reads dim=() as every dim; torch_xla 2.9 alone as none
    "amax": lambda h: h.abs().amax(),
    "amin_keepdim": lambda h: h.amin(keepdim=True),
    "sum": lambda h: h.sum(()),
    "mean": lambda h: h.mean(()),
    "vector_norm": lambda h: torch.linalg.vector_norm(h, dim=()),
}


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
@pytest.mark.parametrize("name", sorted(REDUCTIONS_OVER_EMPTY_DIM))
def test_reductions_over_an_empty_dim_reduce_every_dim(name, remat):
    """``h / (1 + h.abs().amax())`` in a body: on XLA the While gives the loop's
    values and gradients (torch_xla's own eager ops return the input unreduced),
    also where the backward recomputes the reduction."""
    reduce = REDUCTIONS_OVER_EMPTY_DIM[name]

    def make_body(w):
        def body(h, x):
            h = torch.tanh(h @ w + x)
            h = h / (1 + reduce(h).abs())
            return h, reduce(h).sum()
        return body

    w, h, xs = torch.randn(4, 4) * 0.5, torch.randn(3, 4), torch.randn(5, 3, 4)
    assert_matches_loop(make_body, [w], h, xs, grad=True, remat=remat)


def _two_layers(scan_fn, w1, w2, init, xs, remat):
    """A two-layer RNN: layer 2 starts from layer 1's final carry and reads its ys."""
    def layer(w):
        return lambda c, x: (torch.tanh(c @ w + x), torch.tanh(c @ w + x) * 0.5)
    c1, y1 = scan_fn(layer(w1), init, xs, remat=remat)
    c2, y2 = scan_fn(layer(w2), c1, y1[1:], remat=remat)
    return c1, c2, y2


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_chained_scans_values_and_grads(remat):
    """A scan whose init and xs are another scan's outputs, with gradients (the XLA output of
    the first carries a functionalization wrapper; the second's body was once run untraced,
    its results HLO constants that XLA refused). Three calls: the make_fx route, Dynamo's
    capture, its guards."""
    g = torch.Generator().manual_seed(7)
    w1, w2 = torch.randn(4, 4, generator=g) * 0.5, torch.randn(4, 4, generator=g) * 0.5
    init, xs = torch.randn(2, 4, generator=g), torch.randn(5, 2, 4, generator=g)
    leaves = [w.clone().requires_grad_() for w in (w1, w2)]
    want_out = _two_layers(lambda f, c, x, remat: reference_scan(f, c, x), *leaves, init, xs, remat)
    want = torch.autograd.grad(weighted_sum(want_out), leaves)
    for _ in range(3):
        dev_leaves = [w.to(DEV).requires_grad_() for w in (w1, w2)]
        out = _two_layers(scan, *dev_leaves, init.to(DEV), xs.to(DEV), remat)
        got = torch.autograd.grad(weighted_sum(out), dev_leaves)
        assert_trees_close(to_cpu((out, got)), (want_out, want), atol=1e-5, rtol=1e-5)


def test_a_scan_under_anomaly_mode_matches_the_loop():
    # anomaly mode's NaN check ran inside the joint's trace, on fake values: an AttributeError
    # (torch formatting its data-dependent error) for every scan on XLA; see test_autograd
    with torch.autograd.set_detect_anomaly(True):
        assert_matches_loop(_linear(lambda c, w, b: torch.nn.functional.linear(c, w, b)), [W, BIAS], INIT, XS,
                            grad=True, atol=1e-4, rtol=1e-4)


_EXTREMUM_XS = [[-0.1038, -0.5035], [-0.3825, -0.8972], [0.2187, 0.1114], [0.8624, -0.2886],
                [-1.0426, 0.4791], [-0.4999, 0.1041], [-0.3595, -0.0585]]


@pytest.mark.parametrize("reduce", ["amax", "amin", "max", "min"])
@pytest.mark.parametrize("unroll", [1, 2, 3])
def test_gradient_of_a_max_of_a_saved_value_in_unrolled_steps(reduce, unroll):
    """Fuzz seed 300028 (xla): at the last step of 7 with unroll 2 or 3, XLA computed the saved
    amax and its saved input in two fusions, 1 ulp apart; amax's gradient compares them exactly,
    found no maximum, and that step's gradient was lost (6.3 off). The backward now recomputes
    a saved max / min from its saved input (trace/peephole.recompute_saved_extrema)."""
    init = torch.tensor([0.0606, 0.0940, 0.1413], dtype=torch.float64)
    xs = torch.tensor(_EXTREMUM_XS, dtype=torch.float64)
    sign = 1 if reduce in ("amax", "max") else -1

    def body(carry, x):
        v2 = x.unsqueeze(-1).expand(2, 3).sum(-1, keepdim=True) * 0.3 + carry.expand(2, 3)
        return v2.mean(0) * 0.5, getattr(v2.abs() * sign, reduce)()

    def grads(device, loop):
        x = xs.clone().to(device).requires_grad_()
        if loop:
            c, ys = reference_scan(body, init, x)
        else:
            c, ys = scan(body, init.to(device), x, unroll=unroll)
        w = torch.arange(1.0, 8.0, dtype=torch.float64).to(device)
        return torch.autograd.grad(c.sum() + (ys * w).sum(), [x])[0].cpu()

    torch.testing.assert_close(grads(DEV, False), grads("cpu", True), atol=1e-10, rtol=1e-10)


def test_a_saved_max_is_recomputed_from_its_saved_input():
    """The forward saves abs(v) (sgn's and amax's input) but not amax(abs(v)) beside it."""
    from torch_scan_hop.trace.partition import partition_body

    c, x = torch.randn(3), torch.randn(2)
    fb = partition_body(lambda c, x: (c * 0.5, (x.unsqueeze(-1) + c).abs().amax()), [c], [x], [], [True, True])
    (outs,) = fb.fwd.graph.find_nodes(op="output")[0].args
    saved = outs[fb.num_carry + fb.num_y:]
    assert not any(n.target is torch.ops.aten.amax.default for n in saved), saved
    assert any(n.target is torch.ops.aten.amax.default for n in fb.bwd.graph.nodes)
