"""A ``torch.cond`` in a scan body on XLA (``xla/conds.py``): staged as both branches and a
select per output, one branch where the two are one graph. Values and float gradients against
the Python loop on the CPU, on both eager routes (make_fx, Dynamo's capture); a branch not taken
that makes NaN (its value and its gradient) never reaches a result."""
import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
from xla_util import assert_matches_loop, force_route  # noqa: E402

from torch_scan_hop import clear_cache  # noqa: E402
from torch_scan_hop.layers import one_code  # noqa: E402
from torch_scan_hop.xla import conds  # noqa: E402

W = torch.randn(4, 4) * 0.5
COND = torch.ops.higher_order.cond  # torch.cond outside Dynamo compiles itself: a make_fx trace calls the op
INIT, KINDS = torch.randn(2, 4) * 0.5, torch.tensor([0, 1, 1, 0, 1])
XS = torch.randn(5, 2, 4) * 0.5


def _chosen(kind_code):
    """A body whose step runs kind 0's or kind 1's code, picked by the step's x."""
    def make_body(w):
        def body(c, x):
            kind, v = x
            (out,) = COND(kind == 0, _as_tuple(kind_code[0]), _as_tuple(kind_code[1]), (c, v, w))
            return out, out.sum(-1)
        return body
    return make_body


def _as_tuple(code):
    return lambda *operands: (code(*operands),)  # the op's branches return a tuple (torch.cond's are made to)


def _tanh(c, v, w):
    return torch.tanh(c @ w + v)


def _sin(c, v, w):
    return torch.sin(c @ w) * v


def _sqrt_of_negative(c, v, w):
    return torch.sqrt(-(c @ w).abs() - 1.0)  # NaN everywhere, value and gradient


def _cases(code):
    return [W], INIT, (KINDS if code is not _sqrt_of_negative else torch.ones(5, dtype=torch.long), XS)


@pytest.mark.parametrize("route", ["make_fx", "dynamo"])
@pytest.mark.parametrize("code", [(_tanh, _sin), (_sqrt_of_negative, _tanh)], ids=["differ", "nan_not_taken"])
def test_cond_values_and_grads_match_loop(monkeypatch, route, code):
    force_route(monkeypatch, route)
    clear_cache()  # each route lowers its own While (the capture would find the make_fx route's by its joint)
    before = conds.counts().get("selected", 0)
    got = assert_matches_loop(_chosen(code), *_cases(code[0]), grad=True, atol=1e-4, rtol=1e-4)
    assert conds.counts().get("selected", 0) > before  # forward, and the backward's cond of the gradients
    assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves(got))


def test_alike_branches_stage_one(monkeypatch):
    """Two kinds that run one graph (``layers.alike``'s usual case under make_fx): no select."""
    force_route(monkeypatch, "make_fx")
    before = dict(conds.counts())
    with torch.no_grad():
        assert_matches_loop(_chosen((_tanh, _tanh)), [W], INIT, (KINDS, XS), atol=1e-5, rtol=1e-5)
    after = conds.counts()
    assert after.get("one_branch", 0) > before.get("one_branch", 0)
    assert after.get("selected", 0) == before.get("selected", 0)


class _Layer(torch.nn.Module):
    """A "sliding" or "full" layer: one weight signature; the kind selects code or is only
    handed along (Gemma 3's ``sliding_window`` under sdpa)."""

    def __init__(self, kind, selects):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kind, self.selects = kind, selects

    def forward(self, h, mask=None):
        z = self.lin(h)
        z = torch.sin(z) if self.selects and self.kind == "full" else torch.tanh(z)
        return h + z * mask


def _stack_and_inputs(selects, device):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_Layer(k, selects) for k in ["sliding", "sliding", "full"] * 2 + ["sliding"]])
    masks = {"sliding": torch.rand(4), "full": torch.rand(4)}
    per_layer = [dict(mask=masks[layer.kind].to(device)) for layer in layers]
    return layers.to(device), torch.randn(2, 4).to(device), per_layer


@pytest.mark.parametrize("route", ["make_fx", "dynamo"])
@pytest.mark.parametrize("selects", [False, True], ids=["kind_passed_along", "kind_selects_code"])
def test_layers_of_two_kinds_are_one_while(monkeypatch, route, selects):
    """``layers.alike`` on XLA: one scan over the seven layers of two kinds (not blocks and a
    nested scan), the loop's values and gradients; kinds whose code traces alike run one layer's
    code (no cond), a cond whose branches differ is a select."""
    import torch_xla

    from torch_scan_hop import scan_layers
    from xla_util import DEV, to_cpu

    force_route(monkeypatch, route)
    want_layers, h0, want_kw = _stack_and_inputs(selects, "cpu")
    h = h0.clone().requires_grad_()
    want = h
    for layer, kw in zip(want_layers, want_kw):
        want = layer(want, **kw)
    want_grads = torch.autograd.grad(want.square().sum(), [h, *want_layers.parameters()])

    layers, h0, per_layer = _stack_and_inputs(selects, DEV)
    clear_cache()  # as above: this route's own lowering
    before = {**conds.counts(), **one_code.counts()}
    h = h0.clone().requires_grad_()
    got = scan_layers(layers, h, layer_kwargs=per_layer, period="auto", unroll=1)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([got])
    assert hlo.count(" while(") == 1, hlo.count(" while(")
    grads = torch.autograd.grad(got.square().sum(), [h, *layers.parameters()])
    torch.testing.assert_close(to_cpu(got), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(to_cpu(grads), want_grads, atol=1e-5, rtol=1e-5)
    grew = {k: v - before.get(k, 0) for k, v in {**conds.counts(), **one_code.counts()}.items()}
    if selects:  # the kinds' code differs: the cond reached the lowering, both branches staged
        assert grew.get("differ", 0) > 0 and grew.get("selected", 0) > 0, grew
    else:  # told before the scan (``layers.one_code``): the step is one layer's code, no cond at all
        assert grew.get("alike", 0) > 0 and not grew.get("selected") and not grew.get("one_branch"), grew
