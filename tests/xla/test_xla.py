"""XLA: one While per scan (forward and backward), values and gradients equal CPU eager."""
import re

import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import scan

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import torch_xla.core.xla_model as xm  # noqa: E402
from xla_util import assert_openxla_matches_eager, force_route, weighted_sum  # noqa: E402

DEV = torch_xla.device()
D = torch.float32


def to_xla(tree):
    return torch.utils._pytree.tree_map(lambda t: t.to(DEV) if isinstance(t, torch.Tensor) else t, tree)


def to_cpu(tree):
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def hlo_of(tensors):
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def count_ops(hlo, opcode):
    return len(re.findall(rf"\b{re.escape(opcode)}\(", hlo))


def rnn_cell(w):
    def cell(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum(-1)
    return cell


def test_forward_is_one_while_and_hlo_size_is_flat_in_length():
    w = (torch.randn(16, 16) * 0.1).to(DEV)  # device data: the HLO holds the scan only
    sizes = []
    for n in (10, 1000):
        c, ys = scan(rnn_cell(w), torch.zeros(4, 16).to(DEV), torch.randn(n, 4, 16).to(DEV))
        hlo = hlo_of([c, ys])
        assert count_ops(hlo, "while") == 1
        assert count_ops(hlo, "tanh") == 1  # the body is lowered once, not unrolled
        sizes.append(len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo, flags=re.M)))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize("reverse", [False, True])
def test_pytree_values_match_cpu(reverse):
    w = torch.randn(3, 3) * 0.5

    def body(c, x):
        h = torch.sin(c["h"] @ w) * x["a"] + x["b"].sum(0)
        return {"h": h, "n": c["n"] + 1}, {"h": h, "k": c["n"] * 2, "none": None}

    init = {"h": torch.randn(2, 3), "n": torch.tensor(0)}
    xs = {"a": torch.randn(5, 2, 3), "b": torch.randn(5, 4, 3)}
    want = scan(body, init, xs, reverse=reverse)
    w = w.to(DEV)
    got = scan(body, to_xla(init), to_xla(xs), reverse=reverse)
    hlo = hlo_of([got[0]["h"], got[1]["h"]])
    assert count_ops(hlo, "while") == 1 and count_ops(hlo, "reverse") == 0
    assert_trees_close(to_cpu(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("unroll", [1, 3, 12])
def test_unroll_values_and_structure(unroll):
    w = torch.randn(8, 8) * 0.3
    init, xs = torch.randn(2, 8), torch.randn(10, 2, 8)
    want = scan(rnn_cell(w), init, xs, reverse=True)
    c, ys = scan(rnn_cell(w.to(DEV)), init.to(DEV), xs.to(DEV), reverse=True, unroll=unroll)
    hlo = hlo_of([c, ys])
    calls_per_iter = min(unroll, 10)
    # unroll >= length: one iteration runs every step, so no While (csrc/hlo_straight.h)
    assert count_ops(hlo, "while") == (0 if calls_per_iter == 10 else 1 if 10 % calls_per_iter == 0 else 2)
    body_calls = len(re.findall(r"\bcall\(.*to_apply=%scan_body\.", hlo))
    assert body_calls == calls_per_iter + (1 if 10 % calls_per_iter else 0)
    assert_trees_close(to_cpu((c, ys)), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_training_grads_match_cpu_and_backward_is_one_while(reverse):
    torch.manual_seed(1)
    w_cpu = (torch.randn(6, 6) * 0.3).requires_grad_()
    init_cpu = torch.randn(3, 6, requires_grad=True)
    xs_cpu = torch.randn(7, 3, 6, requires_grad=True)

    def loss(w, init, xs):
        c, ys = scan(rnn_cell(w), init, xs, reverse=reverse)
        return (c ** 2).sum() + ys.sin().sum()

    want = torch.autograd.grad(loss(w_cpu, init_cpu, xs_cpu), (w_cpu, init_cpu, xs_cpu))
    w, init, xs = (t.detach().to(DEV).requires_grad_() for t in (w_cpu, init_cpu, xs_cpu))
    got = torch.autograd.grad(loss(w, init, xs), (w, init, xs))
    assert count_ops(hlo_of(got), "while") == 2  # forward While + backward While
    assert_trees_close(to_cpu(got), want, atol=1e-4, rtol=1e-4)


def test_module_parameters_get_grads():
    torch.manual_seed(2)
    lin = torch.nn.Linear(4, 4)
    lin_x = torch.nn.Linear(4, 4).to(DEV)
    lin_x.load_state_dict(lin.state_dict())
    init, xs = torch.randn(2, 4), torch.randn(5, 2, 4)
    for m, i, x in ((lin, init, xs), (lin_x, init.to(DEV), xs.to(DEV))):
        c, ys = scan(lambda c, x: (torch.tanh(m(c) + x), c.mean()), i, x)
        (c.sum() + ys.sum()).backward()
    assert_trees_close([p.grad.cpu() for p in lin_x.parameters()], [p.grad for p in lin.parameters()],
                       atol=1e-5, rtol=1e-5)


def test_int_and_bool_carries_and_ys_without_grad_path():
    def body(c, x):
        n, flag, h = c
        h = h * 0.5 + x
        return (n + 1, flag | (h.sum() > 0), h), (n * 3, h.detach().argmax())

    init = (torch.tensor(0), torch.tensor(False), torch.zeros(3))
    xs = torch.randn(6, 3)
    want = scan(body, init, xs)
    got = scan(body, to_xla(init), xs.to(DEV))
    assert_trees_close(to_cpu(got), want)
    with torch.no_grad():
        assert_trees_close(to_cpu(scan(body, to_xla(init), xs.to(DEV))), want)


def test_zero_length():
    w = torch.randn(3, 3, device=DEV)
    c, ys = scan(rnn_cell(w), torch.ones(2, 3, device=DEV), torch.randn(0, 2, 3, device=DEV))
    assert ys.shape == (0, 2) and ys.device.type == "xla"
    assert torch.equal(c.cpu(), torch.ones(2, 3))


def test_random_numbers_differ_per_step_and_repeat_with_seed():
    def body(c, x):
        noise = torch.rand(4, device=x.device)
        return c + noise.sum(), torch.nn.functional.dropout(x, 0.5) + noise

    def run():
        xm.set_rng_state(1234)
        return to_cpu(scan(body, torch.zeros((), device=DEV), torch.ones(6, 4, device=DEV)))

    (c1, ys1), (c2, ys2) = run(), run()
    assert torch.equal(ys1, ys2) and torch.equal(c1, c2)
    assert len({tuple(row.tolist()) for row in ys1}) == 6  # a different draw on every step
    dropped, kept = ys1 < 1, ys1 >= 2  # x = 1: dropped -> noise, kept -> 2 + noise
    assert bool((dropped | kept).all()) and bool(dropped.any()) and bool(kept.any())


def test_repeated_call_reuses_the_lowered_while(monkeypatch):
    """The body is traced every call (only its graph says what it computes);
    the XLA While is lowered once per distinct graph, and the body's Python
    runs a fixed number of times per call whatever the length."""
    from torch_scan_hop.xla import lower as xla_lower

    lowered = [0]
    real_lower = xla_lower._lower

    def counting_lower(*args):
        lowered[0] += 1
        return real_lower(*args)

    monkeypatch.setattr(xla_lower, "_lower", counting_lower)
    calls = [0]
    w = torch.randn(5, 5, device=DEV, requires_grad=True)

    def cell(c, x):
        calls[0] += 1
        return torch.tanh(c @ w + x), c.sum()

    torch_scan_hop.clear_cache()
    per_call = []
    for n in (4, 4, 9):
        calls[0] = 0
        c, ys = scan(cell, torch.zeros(2, 5, device=DEV), torch.randn(n, 2, 5, device=DEV))
        (c.sum() + ys.sum()).backward()
        per_call.append(calls[0])
    assert lowered[0] == 2 + 2  # forward and backward While, once per length
    assert per_call[0] == per_call[1] == per_call[2] <= 4  # traces, not steps
    assert w.grad is not None


@pytest.mark.parametrize("route", ["make_fx", "dynamo"])
def test_writes_into_the_carry_on_xla(route, monkeypatch):
    """In-place writes into the carry (issue 63), also at a 0-d tensor index, with gradients, on
    both eager routes (twice: on Dynamo's route the second call runs on the guards)."""
    force_route(monkeypatch, route)
    def body(carry, x, t):
        c, buf = carry
        c.mul_(0.5).add_(x)
        buf[t] = c * 2
        return (c, buf), buf[t].sum() + c

    g = torch.Generator().manual_seed(0)
    c0, xs = torch.randn(3, generator=g), torch.randn(4, 3, generator=g)

    def run(device):
        c, x = c0.to(device).requires_grad_(), xs.to(device).requires_grad_()
        out = scan(body, (c * 1.0, torch.zeros(4, 3, device=device)), x, with_index=True)
        return to_cpu((out, torch.autograd.grad(weighted_sum(out), (c, x))))

    want = run("cpu")
    for _ in range(2):
        assert_trees_close(run(DEV), want)


def test_openxla_backend_uses_the_while_lowering_forward_and_training(monkeypatch):
    from torch_scan_hop.xla import lower as xla_lower

    lowered = []
    real_lower = xla_lower._lower
    monkeypatch.setattr(xla_lower, "_lower", lambda *a, **k: lowered.append(1) or real_lower(*a, **k))
    torch.manual_seed(4)
    w_cpu = (torch.randn(8, 8) * 0.3).requires_grad_()

    def loss(w, c0, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs, reverse=True)
        return c.sum() + ys.sum()

    assert_openxla_matches_eager(loss, w_cpu, torch.zeros(2, 8), torch.randn(6, 2, 8))
    assert lowered  # the scan ran as our XLA While, not as an unrolled loop


class _Round(torch.autograd.Function):
    """Straight-through rounding: autograd of the forward would give zero."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _xla_bodies(w):
    def no_grad_region(c, x):
        with torch.no_grad():
            s = c * 2
        return c * s + x @ w, None

    def custom_function(c, x):
        return _Round.apply(c * 3.3) * 0.1 + torch.tanh(x @ w), None

    def closure_read_twice(c, x):
        return torch.tanh(torch.tanh(c @ w + x) @ w), None

    return {"no_grad_region": no_grad_region, "custom_function": custom_function,
            "closure_read_twice": closure_read_twice}


@pytest.mark.parametrize("name", ["no_grad_region", "custom_function", "closure_read_twice"])
def test_what_only_autograd_sees_survives_on_xla(name):
    """The joint is traced from the user's body: no_grad regions and custom
    backwards give the loop's gradients on XLA too."""
    torch.manual_seed(0)
    w_cpu, xs_cpu = torch.randn(3, 3), torch.randn(4, 2, 3)

    def run(device, use_scan):
        w = w_cpu.to(device).requires_grad_()
        init = torch.ones(2, 3, device=device, requires_grad=True)
        body, xs = _xla_bodies(w)[name], xs_cpu.to(device)
        if use_scan:
            c, _ = scan(body, init, xs)
        else:
            c = init
            for x in xs:
                c, _ = body(c, x)
        return [t.cpu() for t in (c, *torch.autograd.grad(c.pow(2).sum(), [init, w]))]

    assert_trees_close(run(DEV, True), run("cpu", False), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("grad_mode", [True, False])
def test_body_branching_on_grad_mode_takes_the_loops_branch(grad_mode):
    def body(c, x):
        return (c * 2 + x if torch.is_grad_enabled() else c * 3 + x), None

    init, xs = torch.ones(3), torch.ones(4, 3)
    with torch.set_grad_enabled(grad_mode):
        want = init
        for x in xs:
            want, _ = body(want, x)
        got = scan(body, init.to(DEV), xs.to(DEV))[0].cpu()
    torch.testing.assert_close(got, want)


def test_ops_xla_cannot_run_in_a_while_are_clear_errors_not_crashes():
    """linalg.solve has no XLA lowering (torch_xla runs it on the CPU from the
    values, which a While step has not got): a ScanError, not a segfault.
    logdet has no backward on XLA tensors: a ScanError, not a wrong gradient."""
    a = (torch.eye(3, dtype=torch.float64) * 2).to(DEV)
    init, xs = torch.ones(3, dtype=torch.float64, device=DEV), torch.ones(4, 3, dtype=torch.float64, device=DEV)
    with pytest.raises(torch_scan_hop.ScanError, match=r"_linalg_solve_ex.*has no XLA lowering"):
        scan(lambda c, x: (torch.linalg.solve(a, c + x), None), init, xs)
    c0 = (torch.eye(3, dtype=torch.float64) * 0.5).to(DEV).requires_grad_()
    body = lambda c, x: (c + x[0, 0], torch.logdet(c @ c.T + torch.eye(3, dtype=c.dtype, device=c.device)))  # noqa: E731
    with pytest.raises(torch_scan_hop.ScanError, match=r"backward of aten::logdet"):
        scan(body, c0, torch.ones(4, 3, 3, dtype=torch.float64, device=DEV))


@pytest.mark.parametrize("grad", [False, True])
def test_a_body_with_no_carry_and_no_y(grad):
    """Every leaf of the carry and of y None: nothing to return. Building the While for it raised
    torch_xla's "No XlaOp with handle 0" (fuzz seeds 400009, 400085); it returns the Nones, as the loop."""
    w = torch.randn(3, 3).to(DEV).requires_grad_(grad)
    xs = torch.randn(4, 2, 3).to(DEV).requires_grad_(grad)
    carry, ys = scan(lambda c, x: ({"h": None}, None) if (x @ w).sum() is not None else None, {"h": None}, xs)
    assert carry == {"h": None} and ys is None


def test_a_scans_outputs_are_ordinary_xla_tensors_for_torch_compile():
    """Eager XLA outputs were wrapped at functorch level 0: a function compiled with Dynamo
    failed on them ("assert t.unwrapped is not None"), and so did the capture of a second scan
    fed the first one's carry, which was then traced again on every step (a scanned model's
    leftover layers after its blocks)."""
    dev = torch_xla.device()
    xs, c0 = torch.randn(3, 2), torch.zeros(2)
    c, ys = scan(lambda c, x: (c + x, c * 2), c0.to(dev), xs.to(dev))
    f = lambda a, b: a * 2 + b.sum(0)  # noqa: E731
    want = f(*reference_scan(lambda c, x: (c + x, c * 2), c0, xs))
    got = torch.compile(f, backend="openxla", fullgraph=True)(c, ys)
    torch.testing.assert_close(got.cpu(), want)

    def second(c, x):
        return c * x, c

    for _ in range(2):  # the first call is traced, the next captured by Dynamo: not refused
        scan(second, c, xs.to(dev))
    assert torch_scan_hop.xla.eager.applies(second, [c, xs.to(dev)], "save_all")


def test_writes_into_a_closed_over_tensor_on_xla():
    """``cache[t] = h`` into a closed-over tensor (issue 63): the caller's tensor holds what the loop
    leaves in it; values and gradients. The second call's Dynamo capture refuses the write, and the
    make_fx path runs it."""
    def make(cache):
        def body(c, x, t):
            c = torch.tanh(c * 0.7 + x)
            cache[t] = c
            return c, cache[t].sum() + cache.sum()
        return body

    g = torch.Generator().manual_seed(0)
    c0, xs = torch.randn(2, 3, generator=g), torch.randn(4, 2, 3, generator=g)

    def run(device):
        c, x = c0.to(device).requires_grad_(), xs.to(device).requires_grad_()
        cache = torch.zeros(4, 2, 3, device=device)
        out = scan(make(cache), c, x, with_index=True)
        return to_cpu((out, torch.autograd.grad(weighted_sum(out), (c, x)), cache.detach()))

    want = run("cpu")
    for _ in range(2):
        assert_trees_close(run(DEV), want)
