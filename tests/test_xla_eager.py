"""Eager scan on XLA through Dynamo's guards: an unchanged body is not traced
again, and whatever the body reads that changed is seen (values and gradients
against the Python loop), as it was when every call traced the body."""
import sys

import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import ScanError, _compat, scan, scan_layers
from torch_scan_hop.xla import eager as xla_eager

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")

DEV = torch_xla.device()
SCALE = 0.5  # read by a body as a global


@pytest.fixture
def traces(monkeypatch):
    """Counts make_fx traces of bodies (the cost the guards avoid)."""
    count = [0]
    real = _compat.trace_aten_graph

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_compat, "trace_aten_graph", counting)
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


def test_a_second_call_is_not_traced_again_and_matches_the_loop(traces):
    w, init, xs = _problem(0)
    first = _run_and_grads(_cell, w, init, xs, DEV)
    assert traces[0] > 0
    traces[0] = 0
    w2, init2, xs2 = _problem(1)  # new values, same shapes: the same graph
    got = _run_and_grads(_cell, w2, init2, xs2, DEV)
    assert traces[0] == 0
    assert_trees_close(first, _run_and_grads(_cell, w, init, xs, "cpu"), atol=1e-4, rtol=1e-4)
    assert_trees_close(got, _run_and_grads(_cell, w2, init2, xs2, "cpu"), atol=1e-4, rtol=1e-4)


def test_a_changed_global_a_closure_and_an_in_place_write_are_seen(monkeypatch):
    w, init, xs = _problem(2)
    _run_and_grads(_cell, w, init, xs, DEV)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 2.0)
    assert_trees_close(_run_and_grads(_cell, w, init, xs, DEV), _run_and_grads(_cell, w, init, xs, "cpu"),
                       atol=1e-4, rtol=1e-4)

    bias = torch.ones(4, device=DEV)
    cells = []
    for b in (bias, torch.full((4,), 3.0, device=DEV)):  # a closure rebound to another tensor
        cells.append(scan(lambda c, x, b=b: (c + x * b, None), torch.zeros(4, device=DEV), torch.ones(3, 4, device=DEV))[0])
    bias.mul_(5)  # an in-place write to a closed-over tensor
    cells.append(scan(lambda c, x: (c + x * bias, None), torch.zeros(4, device=DEV), torch.ones(3, 4, device=DEV))[0])
    assert [c.cpu().tolist() for c in cells] == [[3.0] * 4, [9.0] * 4, [15.0] * 4]


def test_a_body_dynamo_cannot_capture_runs_traced_and_is_not_offered_again(traces, capsys):
    def body(c, x):
        print("tracing")  # a graph break: Dynamo cannot capture it whole
        return c * 0.9 + x, c.sum()

    init, xs = torch.ones(3), torch.randn(4, 3)
    for _ in range(2):
        got = scan(body, init.to(DEV), xs.to(DEV))
        assert_trees_close([t.cpu() for t in got], list(_loop(body, init, xs)), atol=1e-6, rtol=1e-6)
    assert xla_eager._body_key(body) in xla_eager._refused
    assert capsys.readouterr().out.count("tracing") == 2 * (1 + 4)  # per round: one trace on XLA, the loop's 4


def test_a_user_error_is_the_same_scan_error_and_does_not_refuse_the_body():
    def body(c, x):
        return c.sum(), None  # the carry changes shape

    with pytest.raises(Exception, match=r"carry.*shape"):
        scan(body, torch.ones(3, device=DEV), torch.ones(2, 3, device=DEV))
    assert xla_eager._body_key(body) not in xla_eager._refused


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

    check()
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
