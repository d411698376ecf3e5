"""stack_layers when the layers change under it: replaced Parameters, edited containers,
functional_call, hooks and attributes, eagerly and compiled; each falls back to stacking per call
(or recompiles) and matches the loop over an unstacked copy."""
import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from conftest import assert_trees_close
from decoder import Calling, run_loop
from test_stack_layers import Block, assert_views, blocks, grads, pair, run_scan, step

from torch_scan_hop import ScanError, scan_layers, stack_layers


@pytest.mark.parametrize("how", ["setattr", "submodule", "data"])
def test_replaced_parameter_falls_back_to_stacking(how):
    plain, layers = pair()
    new = torch.randn(6, 6, dtype=torch.float64)
    if how == "setattr":
        plain[2].lin.weight = torch.nn.Parameter(new.clone())
        layers[2].lin.weight = torch.nn.Parameter(new.clone())
    elif how == "submodule":  # a new Linear in layer 2: no parameter registered on a stacked module
        for ls in (plain, layers):
            lin = torch.nn.Linear(6, 6, dtype=torch.float64)
            with torch.no_grad():
                lin.weight.copy_(new)
                lin.bias.copy_(plain[2].lin.bias)
            ls[2].lin = lin
    else:
        plain[2].lin.weight.data = new.clone()
        layers[2].lin.weight.data = new.clone()
    x = torch.randn(3, 6, dtype=torch.float64)
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = lambda ls, x: make_fx(lambda x: scan_layers(ls, x))(x)(x)  # noqa: E731 (no Dynamo: aliasing checked)
    assert_trees_close(traced(layers, x), run_loop(plain, x), atol=1e-10, rtol=1e-8)
    if how != "data":  # noticed under torch.compile too
        torch._dynamo.reset()
        fn = torch.compile(run_scan, backend="aot_eager")
        assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                           atol=1e-10, rtol=1e-8)


EDITS = {
    "append": lambda ls, new: ls.append(new),
    "extend": lambda ls, new: ls.extend([new]),
    "insert": lambda ls, new: ls.insert(1, new),
    "setitem": lambda ls, new: ls.__setitem__(2, new),
    "delitem": lambda ls, new: ls.__delitem__(1),
    "pop": lambda ls, new: ls.pop(0),
}


# each edit on one container, the two in turn (both for every edit compiled 36 graphs, ~90 s of CI)
@pytest.mark.parametrize("edit,container", [(edit, (torch.nn.ModuleList, torch.nn.Sequential)[i % 2])
                                            for i, edit in enumerate(sorted(EDITS))])
def test_editing_the_container_falls_back_to_stacking_until_restack(edit, container):
    """A layer added, removed or replaced after stack_layers: the stacks no longer match the
    layers. Traced scans (make_fx, and torch.compile after compiling the unedited stack) use the
    edited layers, values and grads the loop's; restack() makes the stacks current again."""
    torch.manual_seed(0)
    layers4 = [Block() for _ in range(4)]
    base = (container(layers4) if container is torch.nn.ModuleList else container(*layers4)).double()
    plain, layers = copy.deepcopy(base), stack_layers(copy.deepcopy(base))
    x = torch.randn(3, 6, dtype=torch.float64)
    compiled = torch.compile(run_scan, backend="aot_eager")
    torch._dynamo.reset()
    step(compiled, layers, x)  # compiled before the edit
    new = Block().double()
    EDITS[edit](plain, copy.deepcopy(new))
    EDITS[edit](layers, copy.deepcopy(new))
    plain.zero_grad(), layers.zero_grad()
    want = (step(run_loop, plain, x), grads(plain))
    traced = make_fx(lambda x: scan_layers(layers, x))(x)(x)
    assert_trees_close(traced, want[0], atol=1e-10, rtol=1e-8)
    layers.zero_grad()
    assert_trees_close((step(compiled, layers, x), grads(layers)), want, atol=1e-10, rtol=1e-8)
    layers.restack()
    assert_views(layers)
    layers.zero_grad()
    assert_trees_close((step(compiled, layers, x), grads(layers)), want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mode", ["make_fx", "aot_eager"])
def test_parameter_gradient_hooks_run_as_for_the_loop(mode):
    """register_hook (may replace the gradient) and register_post_accumulate_grad_hook on a layer's
    parameter (gradient masking, optimizer-in-backward): the traced stack hands out one stacked
    gradient, and runs each layer parameter's hooks on its row as that parameter's own gradient
    accumulation would (two backward calls: accumulation included)."""
    plain, layers = pair(depth=3)
    x = torch.randn(3, 6, dtype=torch.float64)
    calls = {}

    def hook_up(model, tag):
        for i, layer in enumerate(model):
            layer.lin.weight.register_hook(lambda g, i=i: g * (i + 1))
            layer.lin.bias.register_hook(lambda g: None)  # returns None: the gradient unchanged
            layer.norm.weight.register_post_accumulate_grad_hook(
                lambda p, i=i: calls.setdefault(tag, []).append((i, p.grad.clone())))

    hook_up(plain, "loop"), hook_up(layers, "scan")
    if mode == "aot_eager":
        torch._dynamo.reset()
        fn = torch.compile(run_scan, backend="aot_eager")
    else:
        fn = lambda ls, x: make_fx(lambda x: scan_layers(ls, x))(x)(x)  # noqa: E731
    for _ in range(2):
        want = step(run_loop, plain, x)
        got = step(fn, layers, x)
    assert_trees_close((got, grads(layers)), (want, grads(plain)), atol=1e-10, rtol=1e-8)
    got_calls, want_calls = (sorted(calls[k], key=lambda c: c[0]) for k in ("scan", "loop"))
    assert [i for i, _ in got_calls] == [i for i, _ in want_calls] == [0, 0, 1, 1, 2, 2]
    assert_trees_close([g for _, g in got_calls], [g for _, g in want_calls], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_autograd_grad_and_backward_inputs_of_layer_parameters(backend):
    """The traced stack is ``torch.stack`` of the layers' parameters to autograd, so
    ``torch.autograd.grad(loss, some layers' parameters)`` and ``backward(inputs=...)``
    give what they give for the loop: those parameters' gradients, nobody else's."""
    plain, layers = pair(depth=3)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend=backend, fullgraph=True)

    def picked(model):
        return [model[1].lin.weight, model[2].norm.bias, model[0].lin.bias]

    want = torch.autograd.grad(run_loop(plain, x).pow(2).sum(), picked(plain))
    got = torch.autograd.grad(fn(layers, x).pow(2).sum(), picked(layers))
    assert_trees_close(got, want, atol=1e-10, rtol=1e-8)
    assert all(p.grad is None for p in layers.parameters())
    run_loop(plain, x).pow(2).sum().backward(inputs=[plain[2].lin.weight])
    fn(layers, x).pow(2).sum().backward(inputs=[layers[2].lin.weight])
    assert_trees_close(grads(layers), grads(plain), atol=1e-10, rtol=1e-8)
    assert sum(p.grad is not None for p in layers.parameters()) == 1
    stacks = layers.stacked_inputs()
    got = torch.autograd.grad(fn(layers, x).pow(2).sum(), list(stacks.values()))
    want = torch.autograd.grad(run_loop(plain, x).pow(2).sum(), list(plain.parameters()))
    want = dict(zip([n for n, _ in plain.named_parameters()], want))
    assert_trees_close(list(got), [torch.stack([want[f"{i}.{name}"] for i in range(3)]) for name in stacks],
                       atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mode", ["make_fx", "aot_eager", "func_grad_make_fx"])
def test_functional_call_with_other_parameters_uses_them(mode):
    """torch.func.functional_call(model, params, x) swaps the layers' parameters for the given
    tensors: the scan must read those, not the stacks (it did under torch.compile, silently)."""
    plain, layers = pair(depth=3)
    new = {k: (v.detach() + 0.5).requires_grad_() for k, v in plain.named_parameters()}
    x = torch.randn(3, 6, dtype=torch.float64)
    want = torch.func.functional_call(Calling(plain, run_loop), {"ls." + k: v for k, v in new.items()}, (x,))
    g_want = torch.autograd.grad(want.pow(2).sum(), list(new.values()))
    model = Calling(layers, run_scan)
    f = lambda x: torch.func.functional_call(model, {"ls." + k: v for k, v in new.items()}, (x,))  # noqa: E731
    if mode == "func_grad_make_fx":  # torch.func's own wrapped tensors for the parameters
        loss = lambda params, x: torch.func.functional_call(model, params, (x,)).pow(2).sum()  # noqa: E731
        params = {"ls." + k: v.detach() for k, v in new.items()}
        got = make_fx(torch.func.grad(loss))(params, x)(params, x)
        assert_trees_close([got["ls." + k] for k in new], list(g_want), atol=1e-10, rtol=1e-8)
        return
    if mode == "aot_eager":
        torch._dynamo.reset()
        got = torch.compile(f, backend="aot_eager")(x)
    else:
        got = make_fx(f)(x)(x)
    assert_trees_close(got, want, atol=1e-10, rtol=1e-8)
    if mode == "aot_eager":
        assert_trees_close(torch.autograd.grad(got.pow(2).sum(), list(new.values())), g_want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("kind", ["tensor", "parameter"])
def test_functional_call_swapping_one_parameter_of_a_later_layer(where, kind):
    """functional_call given ONE parameter of layer 2 (a plain tensor or an nn.Parameter): the
    compiled scan must see it whether functional_call runs inside the compiled function or
    around it (a check of layer 0's parameters alone used the stale stack, silently)."""
    plain, layers = pair(depth=3)
    w = torch.randn(6, 6, dtype=torch.float64)
    new = {"2.lin.weight": w.clone().requires_grad_() if kind == "tensor" else torch.nn.Parameter(w.clone())}
    x = torch.randn(3, 6, dtype=torch.float64)
    want_layers = copy.deepcopy(plain)
    with torch.no_grad():
        want_layers[2].lin.weight.copy_(w)
    want = run_loop(want_layers, x)
    g_want = torch.autograd.grad(want.pow(2).sum(), want_layers[2].lin.weight)
    torch._dynamo.reset()
    compiled = torch.compile(run_scan, backend="aot_eager")
    step(compiled, layers, x)  # compiled once with the stack's own parameters
    new = {"ls." + k: v for k, v in new.items()}
    if where == "inside":
        got = torch.compile(lambda x: torch.func.functional_call(Calling(layers, run_scan), new, (x,)),
                            backend="aot_eager")(x)
    else:  # swapped in eager, then the compiled function runs
        got = torch.func.functional_call(Calling(layers, compiled), new, (x,))
    assert_trees_close(got, want, atol=1e-10, rtol=1e-8)
    assert_trees_close(torch.autograd.grad(got.pow(2).sum(), new["ls.2.lin.weight"]), g_want, atol=1e-10, rtol=1e-8)
    assert_trees_close(step(compiled, layers, x), step(run_loop, plain, x), atol=1e-10, rtol=1e-8)  # restored


def test_replacing_a_parameter_after_compiling_recompiles_to_the_fallback():
    plain, layers = pair()
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend="aot_eager")
    step(fn, layers, x)
    new = torch.randn(6, 6, dtype=torch.float64)
    plain[2].lin.weight = torch.nn.Parameter(new.clone())
    layers[2].lin.weight = torch.nn.Parameter(new.clone())
    plain.zero_grad()
    layers.zero_grad()
    assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                       atol=1e-10, rtol=1e-8)


class Tuned(torch.nn.Module):
    """Plain attributes the body reads: a float, a dropout's flags, a LayerNorm's shape tuple and eps."""

    def __init__(self, d=3):
        super().__init__()
        self.lin, self.norm, self.drop, self.scale = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), torch.nn.Dropout(0.0), 1.0

    def forward(self, h):
        return self.drop(torch.tanh(self.lin(self.norm(h))) * self.scale) * self.scale


@pytest.mark.parametrize("change, message", [
    (lambda ls: setattr(ls[2], "scale", 2.0), r"layer 2's attribute 'scale' is 2.0 but layer 0's is 1.0"),
    (lambda ls: setattr(ls[2], "scale", torch.tensor(1.0)), r"layer 2's attribute 'scale' is a tensor of shape \[\] but"),
    (lambda ls: ls[1].drop.eval(), r"layer 1's attribute 'drop.training' is False but layer 0's is True"),
    (lambda ls: setattr(ls[3].norm, "eps", 1e-3), r"layer 3's attribute 'norm.eps' is 0.001"),
    (lambda ls: setattr(ls[1].norm, "normalized_shape", (4,)), r"layer 1's attribute 'norm.normalized_shape' is \(4,\)"),
])
def test_a_compiled_stack_sees_one_layer_change_an_attribute_it_reads(change, message):
    """Compiled once, then one layer's attribute changes: the guards on the other layers'
    attributes recompile and the difference is refused, naming layer and attribute."""
    torch._dynamo.reset()
    layers = stack_layers(torch.nn.ModuleList(Tuned() for _ in range(4)).double())
    compiled = torch.compile(run_scan, backend="eager", fullgraph=True)
    h = torch.randn(2, 3, dtype=torch.float64)
    assert_trees_close(compiled(layers, h), run_loop(layers, h), atol=1e-12, rtol=1e-10)
    change(layers)
    with pytest.raises(ScanError, match=message):
        compiled(layers, h)


@pytest.mark.parametrize("where", ["layer", "submodule", "global"])
def test_a_compiled_stack_refuses_hooks_present_when_compiling(where):
    torch._dynamo.reset()
    layers = stack_layers(torch.nn.ModuleList(Tuned() for _ in range(4)))
    target = {"layer": layers[2], "submodule": layers[1].norm}.get(where)
    hook = (torch.nn.modules.module.register_module_forward_hook(lambda *a: None) if target is None
            else target.register_forward_pre_hook(lambda *a: None))
    want = {"layer": r"layer 2 has module hooks", "submodule": r"layer 1 \(norm\) has module hooks",
            "global": r"global nn.Module hooks are registered"}[where]
    try:
        with pytest.raises(ScanError, match=want):
            torch.compile(run_scan, backend="eager", fullgraph=True)(layers, torch.randn(2, 3))
    finally:
        hook.remove()
    torch._dynamo.reset()
    h = torch.randn(2, 3)
    assert_trees_close(torch.compile(run_scan, backend="eager", fullgraph=True)(layers, h), run_loop(layers, h))


def test_compiling_wraps_no_parameter_past_layer_0(monkeypatch):
    """Under torch.compile the check that every layer still holds the stack's Parameters is
    answered when tracing and kept by identity guards: Dynamo wraps the same tensors at any depth
    (wrapping each layer's parameters cost ~2.5 ms each: the first compile grew with depth)."""
    from torch._dynamo.variables.builder import VariableBuilder

    wrapped, counts = [], []
    wrap = VariableBuilder.__call__  # (not wrap_tensor: a cached type table holds it)

    def counting(self, value):
        if isinstance(value, torch.Tensor):
            wrapped.append(value)
        return wrap(self, value)

    monkeypatch.setattr(VariableBuilder, "__call__", counting)
    x = torch.randn(3, 6, dtype=torch.float64)
    for depth in (2, 5):
        layers = stack_layers(blocks(depth))
        torch._dynamo.reset()
        wrapped.clear()
        torch.compile(run_scan, backend="eager", fullgraph=True)(layers, x)
        counts.append(len(wrapped))
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize("what", ["submodule", "parameter"])
def test_a_layer_changed_inside_the_compiled_function_is_used(what):
    """The compiled frame itself replaces a later layer's submodule, or one of its parameters
    (as functional_call's swap does), before scanning: the real objects do not show it yet when
    the check is answered; the scan must use the new one."""
    plain, layers = pair()
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.manual_seed(1)
    new = torch.nn.Linear(6, 6, dtype=torch.float64) if what == "submodule" else torch.randn(6, dtype=torch.float64)

    def change_then_scan(fn, ls, new, x):
        if what == "submodule":
            ls[3].lin = new
        else:
            ls[3].lin._parameters["bias"] = new
        return fn(ls, x)

    want = change_then_scan(run_loop, plain, copy.deepcopy(new), x)
    torch._dynamo.reset()
    got = torch.compile(change_then_scan, backend="aot_eager", fullgraph=True)(run_scan, layers, copy.deepcopy(new), x)
    assert_trees_close(got, want, atol=1e-10, rtol=1e-8)


def test_a_compiled_model_sees_a_later_layers_parameter_swapped_around_it():
    """The stack reached as a model's attribute (``self.ls``, the usual case) in a compiled
    ``forward``; functional_call then swaps one parameter of the last layer: the guards on the
    layers' parameters send the call to a recompile that reads the swapped tensor."""
    plain, layers = pair()
    model = Calling(layers, run_scan)
    model.compile(backend="aot_eager")
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    assert_trees_close(model(x), run_loop(plain, x), atol=1e-10, rtol=1e-8)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    got = torch.func.functional_call(model, {"ls.3.lin.bias": w}, (x,))
    with torch.no_grad():
        plain[3].lin.bias.copy_(w)
    assert_trees_close(got, run_loop(plain, x), atol=1e-10, rtol=1e-8)
