"""Eager scan on XLA: the first call of a body on given shapes is traced with
make_fx, the next is captured by Dynamo and later ones run on its guards. An
unchanged body is not traced again, and whatever the body reads that changed
is seen (values and gradients against the Python loop), as it was when every
call traced the body."""
import sys

import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import ScanError, clear_cache, scan, scan_layers
from torch_scan_hop.trace import graph as trace_graph_module
from torch_scan_hop.xla import eager as xla_eager

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

DEV = torch_xla.device()
SCALE = 0.5  # read by a body as a global


@pytest.fixture
def traces(monkeypatch):
    """Counts make_fx traces of bodies (the cost the guards avoid)."""
    count = [0]
    real = trace_graph_module.trace_aten_graph

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_graph_module, "trace_aten_graph", counting)
    return count


def _loop(body, init, xs):
    c, ys = init, []
    for x in xs:
        c, y = body(c, x)
        ys.append(y)
    return c, torch.stack(ys)


def _run_and_grads(body, w, init, xs, device):
    w, init, xs = (t.detach().to(device).requires_grad_() for t in (w, init, xs))
    run = scan if device == DEV else _loop
    c, ys = run(lambda c, x: body(c, x, w), init, xs)
    loss = c.pow(2).sum() + ys.sin().sum()
    return [t.cpu() for t in (c, ys, *torch.autograd.grad(loss, [w, init, xs]))]


def _cell(c, x, w):
    c = torch.tanh(c @ w * SCALE + x)
    return c, c.sum(-1)


def _problem(seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 4, generator=gen), torch.randn(2, 4, generator=gen), torch.randn(5, 2, 4, generator=gen))


def _run(body, w, init, xs, device):
    w, init, xs = (t.to(device) for t in (w, init, xs))
    run = scan if device == DEV else _loop
    with torch.no_grad():
        return [t.cpu() for t in run(lambda c, x: body(c, x, w), init, xs)]


@pytest.mark.parametrize("trains", [False, True])
def test_the_first_call_is_traced_the_second_captured_and_later_ones_not_traced(traces, trains):
    """With grad mode on and a weight to train as under no_grad: the first call of a body takes
    make_fx, the second Dynamo's capture, later ones the guards (xla/eager.py)."""
    clear_cache()
    problems = [_problem(seed) for seed in range(3)]  # new values, same shapes: the same graph
    run = _run_and_grads if trains else _run
    got = []
    for i, (w, init, xs) in enumerate(problems):
        traces[0] = 0
        got.append(run(_cell, w, init, xs, DEV))
        assert len(xla_eager._entries) == (i > 0)  # Dynamo's entry, made by its first capture
        assert (traces[0] > 0) == (i < 2), (i, traces[0])  # make_fx, then Dynamo's capture
    for (w, init, xs), g in zip(problems, got):
        assert_trees_close(g, run(_cell, w, init, xs, "cpu"), atol=1e-4, rtol=1e-4)


def test_a_changed_global_a_closure_and_an_in_place_write_are_seen(monkeypatch):
    w, init, xs = _problem(2)
    for _ in range(3):  # the first call is traced, the second captured: the third runs on the guards
        _run_and_grads(_cell, w, init, xs, DEV)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 2.0)
    for _ in range(2):  # the changed global fails the guard (a new capture), then holds it
        assert_trees_close(_run_and_grads(_cell, w, init, xs, DEV), _run_and_grads(_cell, w, init, xs, "cpu"),
                           atol=1e-4, rtol=1e-4)

    def add(b):
        return lambda c, x: (c + x * b, None)

    bias = torch.ones(4, device=DEV)
    cells = [scan(add(b), torch.zeros(4, device=DEV), torch.ones(3, 4, device=DEV))[0]
             for b in (bias, bias, bias, torch.full((4,), 3.0, device=DEV))]  # a closure rebound to another tensor
    bias.mul_(5)  # an in-place write to a closed-over tensor
    cells.append(scan(add(bias), torch.zeros(4, device=DEV), torch.ones(3, 4, device=DEV))[0])
    assert [c.cpu().tolist() for c in cells] == [[3.0] * 4] * 3 + [[9.0] * 4, [15.0] * 4]


@pytest.mark.parametrize("change", ["closure value", "closure tensor", "global", "shape", "dtype", "grad mode"])
def test_a_change_after_the_first_call_or_the_capture_is_seen(change, monkeypatch):
    """Calls 0-4 of one body code, changed before calls 1 and 3: whichever path
    meets the change (make_fx on a first sight, Dynamo's capture, a failed guard)
    gives the loop's values and gradients."""
    clear_cache()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    state = {"scale": 0.5, "dtype": torch.float64, "rows": 2, "grad": True}

    def body(c, x, w_):
        return _cell(c * state["scale"], x, w_)

    def run(device, init, xs):
        grad = state["grad"]
        w_, init, xs = (t.detach().to(device).requires_grad_(grad) for t in (w.to(state["dtype"]), init, xs))
        with torch.set_grad_enabled(grad):
            c, ys = (scan if device == DEV else _loop)(lambda c, x: body(c, x, w_), init, xs)
        assert c.requires_grad == grad
        grads = torch.autograd.grad(c.pow(2).sum() + ys.sin().sum(), [w_, init, xs]) if grad else []
        return [t.detach().cpu() for t in (c, ys, *grads)]

    for call in range(5):
        if call in (1, 3):
            if change == "closure value":
                state["scale"] *= 3
            elif change == "closure tensor":
                w = w * 2
            elif change == "global":
                monkeypatch.setattr(sys.modules[__name__], "SCALE", SCALE * 2)
            elif change == "shape":
                state["rows"] += 1
            elif change == "dtype":
                state["dtype"] = torch.float32 if state["dtype"] == torch.float64 else torch.float64
            else:
                state["grad"] = not state["grad"]
        init = torch.randn(state["rows"], 4, generator=gen, dtype=torch.float64).to(state["dtype"])
        xs = torch.randn(5, state["rows"], 4, generator=gen, dtype=torch.float64).to(state["dtype"])
        tol = 1e-4 if state["dtype"] == torch.float32 else 1e-9
        assert_trees_close(run(DEV, init, xs), run("cpu", init, xs), atol=tol, rtol=tol)
    assert len(xla_eager._entries) == 1  # the later calls ran through Dynamo


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gain = 1.0

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.gain


def test_scan_layers_sees_a_changed_attribute_and_parameter(traces):
    torch.manual_seed(0)
    ref = torch.nn.ModuleList(_Block() for _ in range(3))
    layers = torch.nn.ModuleList(_Block() for _ in range(3)).to(DEV)
    layers.load_state_dict(ref.state_dict())
    x = torch.randn(2, 4)

    def check():
        h = x
        for layer in ref:
            h = layer(h)
        got = scan_layers(layers, x.to(DEV))
        grads = torch.autograd.grad(got.sum(), list(layers.parameters()))
        want = torch.autograd.grad(h.sum(), list(ref.parameters()))
        assert_trees_close([got.cpu(), *(g.cpu() for g in grads)], [h, *want], atol=1e-4, rtol=1e-4)

    check()  # traced
    check()  # captured
    traces[0] = 0
    check()
    assert traces[0] == 0
    for a, b in zip(ref, layers):
        a.gain = b.gain = 0.5
    with torch.no_grad():
        ref[1].lin.weight.mul_(2)
        layers[1].lin.weight.mul_(2)
    check()


def test_scan_layers_refuses_a_layer_whose_read_attribute_changed_after_a_cached_call():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Block() for _ in range(3)).to(DEV)
    x = torch.randn(2, 4).to(DEV)
    scan_layers(layers, x).sum().backward()
    layers[2].note = "unread"  # differs, but the body never reads it
    scan_layers(layers, x).sum().backward()
    layers[2].gain = 0.5  # read by every step: layer 0's value would be used silently
    with pytest.raises(ScanError, match=r"layer 2's attribute 'gain' is 0.5 but layer 0's is 1.0"):
        scan_layers(layers, x)
    layers[2].gain = 1.0
    layers[1].lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ScanError, match=r"layer 1 \(lin\) has module hooks"):
        scan_layers(layers, x)


def test_more_shapes_than_dynamos_default_recompile_limit_stay_cached(traces):
    """Each new length is a compile of the same body code; past Dynamo's default
    limit (8 per code) the calls would take the make_fx path, a trace each."""
    w = torch.randn(4, 4)
    body = lambda c, x: _cell(c, x, w.to(DEV))  # noqa: E731
    problems = [(torch.randn(2, 4), torch.randn(n, 2, 4)) for n in range(1, 11)]
    for _ in range(2):  # each shape traced, then captured
        for init, xs in problems:
            scan(body, init.to(DEV), xs.to(DEV))
    traces[0] = 0
    for init, xs in problems:
        got = scan(body, init.to(DEV), xs.to(DEV))
        assert_trees_close([t.cpu() for t in got], list(_loop(lambda c, x: _cell(c, x, w), init, xs)),
                           atol=1e-5, rtol=1e-5)
    assert traces[0] == 0


class _SuperCalling(_Block):
    def forward(self, h):
        return super().forward(h) + 1


def test_layers_calling_super_run_on_xla_and_match_the_loop():
    """Dynamo cannot trace zero-argument ``super()`` on the layer view: such a
    stack takes the make_fx path (traced every call) and still gives the loop's values."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_SuperCalling() for _ in range(3))
    x = torch.randn(2, 4)
    want = x
    for layer in layers:
        want = layer(want)
    layers.to(DEV)
    for _ in range(2):
        assert_trees_close(scan_layers(layers, x.to(DEV)).cpu(), want.detach(), atol=1e-5, rtol=1e-5)
    assert any(code.co_name == "step" for code, _ in xla_eager._refused)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scan_in_a_scan_body_on_each_path(reverse):
    """A scan nested in the body (its inner body reading a closure that requires
    grad): the first call traces it inline into the outer step, the second is
    captured by Dynamo with it, the third runs on the guards. Values and gradients
    of the nested loops every time, with and without grad (the first call once
    returned a fake tensor)."""
    w, init, xss = (t.double() for t in _problem(7))
    xss = xss.reshape(5, 1, 2, 4).expand(5, 3, 2, 4).contiguous() + torch.arange(3.0).reshape(1, 3, 1, 1)

    def outer_body(c, xs, w, nested):
        inner = lambda c, x: (torch.tanh(c @ w + x), c.sum(-1))  # noqa: E731
        c2, ys = nested(inner, c, xs)
        return c2 * 0.5, ys.sum(0)

    def run(device, grad):
        wd, cd, xd = (t.detach().to(device).requires_grad_(grad) for t in (w, init, xss))
        if device == DEV:
            c, ys = scan(lambda c, xs: outer_body(c, xs, wd, lambda f, c, xs: scan(f, c, xs, reverse=reverse)), cd, xd)
        else:
            nested = lambda f, c, xs: _loop(f, c, xs.flip(0)) if reverse else _loop(f, c, xs)  # noqa: E731
            c, ys = _loop(lambda c, xs: outer_body(c, xs, wd, nested), cd, xd)  # ys.sum(0): order-free
        if not grad:
            return [t.cpu() for t in (c, ys)]
        loss = c.pow(2).sum() + ys.sin().sum()
        return [t.cpu() for t in (c, ys, *torch.autograd.grad(loss, [wd, cd, xd]))]

    for grad in (False, True):
        want = run("cpu", grad)
        for _ in range(3):
            got = run(DEV, grad)
            assert all(type(t) is torch.Tensor for t in got)
            assert_trees_close(got, want, atol=1e-10, rtol=1e-10)



def test_a_first_call_is_traced_with_or_without_a_weight_to_train(traces):
    """Grad mode on, with nothing to train or with a weight a module holds two closures deep:
    the first call is traced by make_fx, not captured (no Dynamo entry)."""
    clear_cache()
    w, init, xs = (t.to(DEV) for t in _problem(5))
    traces[0] = 0
    scan(lambda c, x: _cell(c, x, w), init, xs)
    assert not xla_eager._entries and traces[0] > 0  # make_fx, no Dynamo entry

    clear_cache()
    lin = torch.nn.Linear(4, 4).to(DEV)

    def make_body(module):
        return lambda c, x: (torch.tanh(module(c) + x), None)
    traces[0] = 0
    scan(make_body(lin), init, xs)[0].sum().backward()
    assert not xla_eager._entries and traces[0] > 0
    assert lin.weight.grad is not None
