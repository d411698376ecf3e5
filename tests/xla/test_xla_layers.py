"""scan_layers' steady training step on XLA: the per-call fast paths see every change.

A steady call skips work the first one did (Dynamo's capture, the plan and While
by graph) and takes cheaper routes for what it still does every call (the
attribute comparison across layers, the weight stack, the gradient rows). These
check that a changed weight, a changed attribute or a frozen layer is still seen,
and that every step's values and gradients are the Python loop's. Each runs twice: with
the default unroll (one While) and with an unroll covering every layer (straight-line, no
While: the form a user asks for with unroll=len(layers)).
"""
import sys

import pytest
import torch
from conftest import assert_trees_close

from torch_scan_hop import ScanError, scan_layers

torch_xla = pytest.importorskip("torch_xla")
UNROLL = None


@pytest.fixture(autouse=True, params=[None, 64], ids=["default", "straight"])  # 64: >= any depth here
def _unroll(request, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "UNROLL", request.param)


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.act, self.scale = torch.nn.Linear(8, 8), torch.nn.GELU(), 0.5

    def forward(self, h):
        return self.act(self.lin(h)) * self.scale


def make(depth=4):
    torch.manual_seed(depth)
    return torch.nn.ModuleList(Scaled() for _ in range(depth)).to(torch_xla.device())


def step(layers, x, stacked):
    h = scan_layers(layers, x, unroll=UNROLL) if stacked else x
    if not stacked:
        for layer in layers:
            h = layer(h)
    h.pow(2).mean().backward()
    torch_xla.sync()
    return h.cpu(), [None if p.grad is None else p.grad.cpu() for p in layers.parameters()]


def both(layers, x, accumulate=False):
    """(scan_layers' step, the loop's step) from the same weights and starting grads."""
    if not accumulate:
        layers.zero_grad(set_to_none=True)
    before = [None if p.grad is None else p.grad.clone() for p in layers.parameters()]
    got = step(layers, x, True)
    for p, g in zip(layers.parameters(), before):
        p.grad = g
    want = step(layers, x, False)
    return got, want


def test_steady_steps_follow_weight_changes_and_match_the_loop():
    layers, x = make(), torch.randn(6, 8).to(torch_xla.device())
    for i in range(4):  # a training call: Dynamo's capture, then steady calls on its guards
        got, want = both(layers, x)
        assert_trees_close(got, want, atol=1e-6, rtol=1e-5)
        with torch.no_grad():
            layers[i % 4].lin.weight.mul_(1.5)  # in place, between steps: the next step must see it
            layers[(i + 1) % 4].lin.bias.add_(0.25)


def test_each_gradient_is_one_buffer_and_accumulates_like_the_loop():
    """Each layer's gradient is one gathered row: as a squeezed view of a [1, ...] gather, the
    sync also returned the view's base, and XLA wrote every gradient twice. Rows are added to
    an existing .grad as the loop's are."""
    import torch_xla.debug.metrics as met

    layers, x = make(), torch.randn(6, 8).to(torch_xla.device())
    for _ in range(3):
        both(layers, x)
    layers.zero_grad(set_to_none=True)
    scan_layers(layers, x, unroll=UNROLL).pow(2).mean().backward()
    grads = [p.grad for p in layers.parameters()]
    met.clear_counters()
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops([])
    assert met.counter_value("CreateDataHandles") == len(grads)  # the step's only live results
    got, want = both(layers, x, accumulate=True)  # .grad already set: rows are added to it
    assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_frozen_layer_gets_no_gradient_and_the_others_theirs():
    layers, x = make(), torch.randn(6, 8).to(torch_xla.device())
    for _ in range(3):
        both(layers, x)
    layers[1].lin.weight.requires_grad_(False)
    for _ in range(2):
        got, want = both(layers, x)
        assert got[1][2] is None and want[1][2] is None  # layer 1's weight
        assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("where", ["layer", "submodule", "every_layer"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "backward"])
def test_hooks_are_refused_after_steady_calls(where, kind):
    """A hook registered after steady calls is seen: the per-call attribute check tests the
    empty hook containers of a module together, then each one when any is not empty; the
    scan refuses hooks by layer, and runs again once they are removed."""
    layers, x = make(), torch.randn(6, 8).to(torch_xla.device())
    for _ in range(3):
        both(layers, x)
    hook = {"forward": lambda m, args, out: out, "forward_pre": lambda m, args: None,
            "backward": lambda m, gin, gout: None}[kind]
    register = {"forward": "register_forward_hook", "forward_pre": "register_forward_pre_hook",
                "backward": "register_full_backward_hook"}[kind]
    targets = {"layer": [layers[2]], "submodule": [layers[1].lin], "every_layer": list(layers)}[where]
    handles = [getattr(m, register)(hook) for m in targets]
    try:
        with pytest.raises(ScanError, match=r"has module hooks"):
            both(layers, x)
    finally:
        for handle in handles:
            handle.remove()
    got, want = both(layers, x)
    assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


def test_attribute_check_skips_empty_hook_containers_together():
    """``tree_agrees``: equal layers agree; a hook (or any non-empty container) on either side
    sends it through the per-attribute comparison, which tells them apart."""
    from torch_scan_hop.layers.attributes import tree_agrees as _tree_agrees

    a, b = Scaled(), Scaled()
    assert _tree_agrees(a, b)
    handle = b.act.register_forward_pre_hook(lambda m, args: None)
    assert not _tree_agrees(a, b) and not _tree_agrees(b, a)
    handle.remove()
    assert _tree_agrees(a, b)
    b.lin._non_persistent_buffers_set.add("x")
    assert not _tree_agrees(a, b)


@pytest.mark.parametrize("change", ["float", "gelu", "training", "set"])
def test_an_attribute_changed_after_steady_steps_is_still_seen(change):
    """The per-call comparison of every layer's attributes (identity and empty containers
    first, ``attributes.tree_agrees``) still sees one layer's change after the steady calls: one the
    body reads is refused, naming layer and attribute; one it does not read runs as the loop."""
    layers, x = make(), torch.randn(6, 8).to(torch_xla.device())
    for _ in range(3):
        both(layers, x)
    match = None
    if change == "float":
        layers[2].scale = 0.25
        match = r"layer 2's attribute 'scale' is 0.25 but layer 0's is 0.5"
    elif change == "gelu":
        layers[3].act.approximate = "tanh"
        match = r"layer 3's attribute 'act.approximate' is 'tanh' but layer 0's is 'none'"
    elif change == "training":
        layers[1].act.eval()  # GELU's forward does not read it
    else:
        layers[2].lin._non_persistent_buffers_set.add("nothing")  # a non-empty set where layer 0's is empty
    if match is not None:
        with pytest.raises(ScanError, match=match):
            both(layers, x)
        return
    got, want = both(layers, x)
    assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


def test_torch_func_grad_of_functional_call_matches_the_loop():
    """The eager stack on XLA is an autograd.Function with setup_context, which torch.func
    accepts: grad of functional_call through scan_layers works (through the custom op it
    raised) and equals the loop's."""
    layers, x = make(3), torch.randn(6, 8).to(torch_xla.device())
    params = {k: v.detach().clone() for k, v in layers.named_parameters()}

    def scanned(p):
        return torch.func.functional_call(_Stack(layers), {"layers." + k: v for k, v in p.items()}, (x,))

    def looped(p):
        h = x
        for i, layer in enumerate(layers):
            h = torch.func.functional_call(layer, {k[len(f"{i}."):]: v for k, v in p.items()
                                                   if k.startswith(f"{i}.")}, (h,))
        return h

    got = torch.func.grad(lambda p: scanned(p).pow(2).sum())(params)
    want = torch.func.grad(lambda p: looped(p).pow(2).sum())(params)
    torch_xla.sync()
    assert_trees_close({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()},
                       atol=1e-6, rtol=1e-5)


class _Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return scan_layers(self.layers, x, unroll=UNROLL)


def test_an_eager_step_then_the_same_layers_under_openxla():
    """The gradient rows' index tensors cached by an eager step were real tensors handed to the
    openxla trace's fake tensor mode ("Please convert all Tensors to FakeTensors first")."""
    layers, x = make(), torch.randn(2, 8).to(torch_xla.device())
    assert_trees_close(*both(layers, x))

    def train(layers, x):
        h = scan_layers(layers, x, unroll=UNROLL)
        return torch.autograd.grad(h.pow(2).mean(), list(layers.parameters()))

    grads = torch.compile(train, backend="openxla")(layers, x)
    layers.zero_grad(set_to_none=True)
    _, want = step(layers, x, False)
    assert_trees_close([g.cpu() for g in grads], want)
