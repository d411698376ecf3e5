"""Eager values against the Python for-loop reference."""
import collections

import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import ScanError, scan
from torch_scan_hop.op.hop import scan_op

Point = collections.namedtuple("Point", ["a", "b"])
W = torch.randn(4, 4)


def rnn(c, x):
    c = torch.tanh(c @ W + x)
    return c, c.sum(-1)


def tree_body(c, x):
    h = torch.tanh(c["h"] @ W + x.a) * x.b
    return {"h": h, "n": c["n"] + 1, "flag": c["flag"] | (h.sum() > 0)}, (h.mean(-1), {"n": c["n"] * 2, "none": None})


def tree_inputs(n=5):
    init = {"h": torch.zeros(2, 4), "n": torch.tensor(0), "flag": torch.tensor(False)}
    return init, Point(torch.randn(n, 2, 4), torch.randn(n, 1, 4))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_rnn_matches_loop(reverse, grad_mode):
    init, xs = torch.randn(2, 4), torch.randn(7, 2, 4)
    with torch.set_grad_enabled(grad_mode):
        got = scan(rnn, init, xs, reverse=reverse)
    assert_trees_close(got, reference_scan(rnn, init, xs, reverse=reverse))


@pytest.mark.parametrize("reverse", [False, True])
def test_pytrees_int_and_bool_carries(reverse):
    init, xs = tree_inputs()
    got = scan(tree_body, init, xs, reverse=reverse)
    assert_trees_close(got, reference_scan(tree_body, init, xs, reverse=reverse))
    assert got[0]["n"].item() == 5 and got[0]["n"].dtype == torch.int64


@pytest.mark.parametrize("dim", [1, 2, -1])
@pytest.mark.parametrize("reverse", [False, True])
def test_dim(dim, reverse):
    xs = torch.randn(2, 3, 5)

    def body(c, x):
        return c + x.sum(), x * c

    got = scan(body, torch.tensor(0.0), xs, dim=dim, reverse=reverse)
    assert_trees_close(got, reference_scan(body, torch.tensor(0.0), xs, dim=dim, reverse=reverse))


def test_length_only_calls_fn_with_none():
    seen = []

    def body(c, x):
        seen.append(x)
        return c * 2, c

    carry, ys = scan(body, torch.tensor(1.0), length=4)
    assert carry.item() == 16.0 and ys.tolist() == [1.0, 2.0, 4.0, 8.0]
    assert all(x is None for x in seen)


def test_length_agreeing_with_xs():
    xs = torch.randn(3, 2)
    assert_trees_close(scan(rnn_add, torch.zeros(2), xs, length=3), reference_scan(rnn_add, torch.zeros(2), xs))


def rnn_add(c, x):
    return c + x, c * x


@pytest.mark.parametrize("reverse", [False, True])
def test_zero_length(reverse):
    init, xs = tree_inputs(0)
    carry, ys = scan(tree_body, init, xs, reverse=reverse)
    assert_trees_close(carry, init)
    assert ys[0].shape == (0, 2) and ys[0].dtype == torch.float32
    assert ys[1]["n"].shape == (0,) and ys[1]["n"].dtype == torch.int64
    assert ys[1]["none"] is None


def test_zero_length_returns_init_itself_and_the_op_copies():
    """The one zero-length rule (``op.loop.carry_after_no_step``): ``scan`` returns init itself,
    as the loop does; the op returns copies, since a HOP's outputs never alias its inputs."""
    init = {"h": torch.ones(2)}
    carry, ys = scan(lambda c, x: (c, x), init, torch.zeros(0, 2))
    assert carry is init and ys.shape == (0, 2)
    out = torch_scan_hop.scan_op(lambda c, x: [c, x], [init["h"]], [torch.zeros(0, 2)], ())
    assert out[0] is not init["h"] and torch.equal(out[0], init["h"]) and out[1].shape == (0, 2)


def test_zero_length_length_only():
    carry, ys = scan(lambda c, x: (c + 1, c.to(torch.int32)), torch.ones(3), length=0)
    assert torch.equal(carry, torch.ones(3)) and ys.shape == (0, 3) and ys.dtype == torch.int32


def test_y_none_and_bool_y():
    carry, ys = scan(lambda c, x: (c + x, None), torch.zeros(2), torch.ones(3, 2))
    assert ys is None and carry.tolist() == [3.0, 3.0]
    _, flags = scan(lambda c, x: (c, x > 0), torch.zeros(()), torch.tensor([-1.0, 2.0]))
    assert flags.tolist() == [False, True]


def test_nn_module_parameters_closure():
    cell = torch.nn.RNNCell(4, 4)

    def body(h, x):
        h = cell(x, h)
        return h, h.sum(-1)

    init, xs = torch.zeros(2, 4), torch.randn(6, 2, 4)
    with torch.no_grad():
        want = reference_scan(body, init, xs)
    got = scan(body, init, xs)  # parameters require grad: takes the lifted path
    assert_trees_close(got, want)


def test_body_returning_list_pair_and_identity_carry():
    got = scan(lambda c, x: [c, x * 2], torch.ones(2), torch.arange(6.0).reshape(3, 2))
    assert torch.equal(got[0], torch.ones(2)) and torch.equal(got[1], torch.arange(6.0).reshape(3, 2) * 2)


def test_scan_op_direct_flat_convention():
    init, xs, w = [torch.randn(2, 4)], [torch.randn(5, 2, 4)], torch.randn(4, 4)

    def combine(c, x, w):
        nc = torch.tanh(c @ w + x)
        return [nc, nc.sum(-1)]

    for reverse in (False, True):
        out = scan_op(combine, init, xs, (w,), reverse=reverse)
        want = reference_scan(lambda c, x: tuple(combine(c, x, w)), init[0], xs[0], reverse=reverse)
        assert_trees_close(tuple(out), want)


def test_op_is_installed_as_torch_ops_higher_order_scan():
    assert torch.ops.higher_order.scan is torch_scan_hop.scan_op
    assert torch._ops._higher_order_ops["scan"] is torch_scan_hop.scan_op


@pytest.mark.parametrize("reverse", [False, True])
def test_upstream_front_end_runs_on_our_op(reverse):
    from torch._higher_order_ops.scan import scan as upstream_scan

    def combine(c, x):
        nc = c + x
        return nc, nc.clone()

    init, xs = torch.zeros(3), torch.randn(5, 3)
    got = upstream_scan(combine, init, xs, reverse=reverse)
    assert_trees_close(tuple(got), reference_scan(combine, init, xs, reverse=reverse))


def test_upstream_front_end_under_compile():
    from torch._higher_order_ops.scan import scan as upstream_scan

    def f(init, xs):
        return upstream_scan(lambda c, x: (c * x, (c * x).clone()), init, xs)

    init, xs = torch.ones(3), torch.rand(4, 3)
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(init, xs)
    assert_trees_close(tuple(got), reference_scan(lambda c, x: (c * x, c * x), init, xs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
def test_dtypes(dtype):
    xs = (torch.rand(5, 3) * 10).to(dtype)
    body = lambda c, x: (c + x, c * 2)  # noqa: E731
    got = scan(body, torch.zeros(3, dtype=dtype), xs)
    assert_trees_close(got, reference_scan(body, torch.zeros(3, dtype=dtype), xs))


def test_gen_schema_matches_upstream_and_names_options():
    from torch._higher_order_ops.scan import scan_op as upstream_scan_op

    assert upstream_scan_op is not torch_scan_hop.scan_op

    def body(c, x, w):
        return [torch.tanh(c @ w + x), c.sum(), x * 2]

    init, xs, w = torch.randn(2, 3), torch.randn(4, 2, 3), torch.randn(3, 3)
    ours = torch_scan_hop.scan_op.gen_schema(body, [init], [xs], (w,))
    assert str(ours) == str(upstream_scan_op.gen_schema(body, [init], [xs], (w,)))
    assert str(ours) == ("scan(Any combine_fn, Tensor init0, Tensor xs0, Tensor additional_input0) "
                         "-> (Tensor, Tensor, Tensor)")
    with_options = torch_scan_hop.scan_op.gen_schema(body, [init], [xs], (w,), reverse=True, unroll=2)
    assert str(with_options).endswith("*, bool reverse, int unroll) -> (Tensor, Tensor, Tensor)")

    def mutating(c, x):
        c.add_(x)
        return [c.clone(), x.clone()]

    with pytest.raises(ScanError, match=r"fn mutates its input in place \(carry leaf 0\)"):
        torch_scan_hop.scan_op.gen_schema(mutating, [init], [xs], ())
