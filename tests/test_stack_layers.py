"""stack_layers: stacked parameter storage, checked against an unstacked deep copy."""
import copy
import io

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from conftest import assert_trees_close, capture_graphs
from decoder import Calling, causal_mask, make_stack, run_loop

from torch_scan_hop import ScanError, scan_layers, stack_layers


class Block(torch.nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, h):
        return h + torch.tanh(self.lin(self.norm(h)))


def blocks(depth=4, dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block() for _ in range(depth)).to(dtype)


def pair(depth=4, dtype=torch.float64):
    plain = blocks(depth, dtype)
    return plain, stack_layers(copy.deepcopy(plain))


def step(fn, layers, x):
    out = fn(layers, x)
    out.pow(2).mean().backward()
    return out.detach()


def grads(layers):
    return [None if p.grad is None else p.grad.clone() for p in layers.parameters()]


def run_scan(layers, x):
    return scan_layers(layers, x)


def assert_same_params(a, b, **kw):
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert_trees_close([p.detach() for p in a.parameters()], [p.detach() for p in b.parameters()], **kw)


def assert_views(layers):
    for name, P in layers.stacked_parameters().items():
        for i, layer in enumerate(layers):
            p = layer.get_parameter(name)
            assert p.untyped_storage().data_ptr() == P.untyped_storage().data_ptr()
            assert p.storage_offset() == P.storage_offset() + i * P.stride(0)


def assert_grads_are_rows_of_one_buffer(layers):
    """Each parameter name's gradients are consecutive rows of one buffer: no per-layer copy."""
    for name in layers.stacked_parameters():
        gs = [layer.get_parameter(name).grad for layer in layers]
        assert len({g.untyped_storage().data_ptr() for g in gs}) == 1, name
        step = gs[0].numel()
        assert [g.storage_offset() - gs[0].storage_offset() for g in gs] == [i * step for i in range(len(gs))], name


def test_layers_are_views_of_one_stack_and_keep_their_parameters():
    plain = blocks()
    params = list(plain.parameters())
    layers = stack_layers(plain)
    assert list(layers.parameters()) == params  # same Parameter objects (optimizers keep them)
    stacks = layers.stacked_parameters()
    assert set(stacks) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias"}
    assert stacks["lin.weight"].shape == (4, 6, 6)
    assert_views(layers)
    assert not any(n.startswith("_scan") for n in layers.state_dict())


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "inductor"])
def test_values_and_grads_match_the_loop(mode):
    plain, layers = pair()
    x = torch.randn(3, 6, dtype=torch.float64)
    fn = run_scan if mode == "eager" else torch.compile(run_scan, backend=mode, fullgraph=True)
    torch._dynamo.reset()
    got = step(fn, layers, x), grads(layers)
    want = step(run_loop, plain, x), grads(plain)
    assert_trees_close(got, want, atol=1e-10, rtol=1e-8)
    if mode != "eager":  # the traced scan took one stacked gradient, handed out as row views
        assert_grads_are_rows_of_one_buffer(layers)
        assert all(layers.stacked_parameters()[n].grad is None for n in layers.stacked_parameters())


def test_decoder_under_inductor_matches_the_loop():
    plain = make_stack(3)
    layers = stack_layers(copy.deepcopy(plain))
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    torch._dynamo.reset()
    fn = torch.compile(lambda l, x: scan_layers(l, x, attn_mask=mask), backend="inductor")
    got = step(fn, layers, x), grads(layers)
    want = step(lambda l, x: run_loop(l, x, attn_mask=mask), plain, x), grads(plain)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)


def _stacks_in(gm):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and ("stack" in str(n.target) or "cat" in str(n.target)))


def test_compiled_graph_does_not_stack_the_weights():
    plain, layers = pair(depth=6)
    x = torch.randn(3, 6, dtype=torch.float64)
    counts = {}
    for name, ls in (("plain", plain), ("stacked", layers)):
        torch._dynamo.reset()
        graphs, backend = capture_graphs()
        step(torch.compile(run_scan, backend=backend, fullgraph=True), ls, x)
        (gm,) = graphs
        counts[name] = (_stacks_in(gm), sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
    assert counts["plain"][0] == 4  # one stack per parameter name, 6 inputs each
    assert counts["stacked"][0] == 0
    assert counts["stacked"][1] < 4 + 4  # x, the four stacks, layer 0's weights at most: not 6 x 4
    assert counts["plain"][1] >= 6 * 4


def test_state_dict_keys_and_round_trips_both_ways():
    plain, layers = pair()
    assert list(layers.state_dict()) == list(plain.state_dict())
    torch.manual_seed(5)
    other = blocks()
    for p in other.parameters():
        p.data.normal_()
    layers.load_state_dict(other.state_dict())  # plain -> stacked: copied into the stack's rows
    assert_views(layers)
    assert_same_params(layers, other)
    assert_trees_close(layers.stacked_parameters()["lin.weight"], torch.stack([m.lin.weight for m in other]))
    fresh = blocks()
    fresh.load_state_dict(layers.state_dict())  # stacked -> plain
    assert_same_params(fresh, other)


def test_load_state_dict_assign_falls_back_to_stacking_per_call():
    plain, layers = pair()
    layers.load_state_dict(plain.state_dict(), assign=True)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend="aot_eager")
    assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)))
    layers.restack()
    assert_views(layers)


@pytest.mark.parametrize("opt", ["sgd", "adamw_foreach", "adamw_fused"])
@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_optimizer_steps_match_the_unstacked_copy(opt, mode):
    plain, layers = pair()
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    }[opt]
    opt_p, opt_s = make(plain.parameters()), make(layers.parameters())
    fn = run_scan if mode == "eager" else torch.compile(run_scan, backend=mode)
    torch._dynamo.reset()
    x = torch.randn(3, 6, dtype=torch.float64)
    for _ in range(3):
        for ls, o, f in ((plain, opt_p, run_loop), (layers, opt_s, fn)):
            o.zero_grad()
            step(f, ls, x)
            o.step()
    assert_same_params(layers, plain, atol=1e-10, rtol=1e-8)
    assert_views(layers)  # the optimizer updated the views in place: the stack moved with them
    got = fn(layers, x)
    assert_trees_close(got, run_loop(plain, x), atol=1e-10, rtol=1e-8)


class SharingBlock(torch.nn.Module):
    """A module shared by every layer, and two weights tied within the layer."""

    def __init__(self, shared, d=6):
        super().__init__()
        self.shared, self.a, self.b = shared, torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.b.weight = self.a.weight

    def forward(self, h):
        return h + torch.tanh(self.shared(h) + self.a(h) - self.b(h).sin())


def sharing_blocks(depth=4):
    torch.manual_seed(0)
    shared = torch.nn.Linear(6, 6)
    return torch.nn.ModuleList(SharingBlock(shared) for _ in range(depth)).double()


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "make_fx"])
def test_shared_and_tied_parameters_stay_one_parameter(mode):
    """A Parameter met twice cannot be one row per layer of a stack (its other rows would be
    stale copies): those names are stacked per call, the rest live stacked; optimizer steps match."""
    plain, layers = sharing_blocks(), stack_layers(sharing_blocks())
    assert sorted(layers.stacked_parameters()) == ["a.bias", "b.bias"]
    assert_views(layers)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = {"eager": run_scan, "aot_eager": torch.compile(run_scan, backend="aot_eager"),
          "make_fx": lambda ls, x: make_fx(lambda x: scan_layers(ls, x))(x)(x)}[mode]
    opts = [torch.optim.SGD(ls.parameters(), lr=0.2) for ls in (plain, layers)]
    for _ in range(3):
        for ls, o, f in ((plain, opts[0], run_loop), (layers, opts[1], fn)):
            o.zero_grad()
            step(f, ls, x)
            o.step()
    assert_same_params(layers, plain, atol=1e-10, rtol=1e-8)
    assert_trees_close(fn(layers, x), run_loop(plain, x), atol=1e-10, rtol=1e-8)


def test_compiled_optimizer_step_on_stacked_views():
    plain, layers = pair()
    opts = [torch.optim.AdamW(ls.parameters(), lr=0.01, foreach=True) for ls in (plain, layers)]
    steps = [torch.compile(o.step, backend="inductor") for o in opts]
    fn = torch.compile(run_scan, backend="inductor")
    torch._dynamo.reset()
    x = torch.randn(3, 6, dtype=torch.float64)
    for _ in range(2):
        for ls, o, s, f in ((plain, opts[0], steps[0], run_loop), (layers, opts[1], steps[1], fn)):
            o.zero_grad()
            step(f, ls, x)
            s()
    assert_same_params(layers, plain, atol=1e-10, rtol=1e-8)
    assert_views(layers)


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_gradient_accumulation_and_zero_grad(mode):
    plain, layers = pair()
    fn = run_scan if mode == "eager" else torch.compile(run_scan, backend=mode)
    torch._dynamo.reset()
    x1, x2 = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    for ls, f in ((plain, run_loop), (layers, fn)):
        step(f, ls, x1)
        step(f, ls, x2)  # no zero_grad: accumulates
    assert_trees_close(grads(layers), grads(plain), atol=1e-10, rtol=1e-8)
    layers.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in layers.parameters())
    plain.zero_grad(set_to_none=False)
    for ls, f in ((plain, run_loop), (layers, fn)):
        step(f, ls, x1)
    assert_trees_close(grads(layers), grads(plain), atol=1e-10, rtol=1e-8)
    layers.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in layers.parameters())
    plain.zero_grad(set_to_none=True)
    for ls, f in ((plain, run_loop), (layers, fn)):
        step(f, ls, x2)
    assert_trees_close(grads(layers), grads(plain), atol=1e-10, rtol=1e-8)


def test_to_dtype_moves_the_stack_and_keeps_the_views():
    plain, layers = pair(dtype=torch.float32)
    params = list(layers.parameters())
    layers.to(torch.float64)
    plain.to(torch.float64)
    assert list(layers.parameters()) == params
    assert all(P.dtype == torch.float64 for P in layers.stacked_parameters().values())
    assert_views(layers)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend="aot_eager")
    assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                       atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_requires_grad_false_on_one_parameter_name(mode):
    plain, layers = pair()
    for ls in (plain, layers):
        for m in ls:
            m.lin.weight.requires_grad_(False)
    fn = run_scan if mode == "eager" else torch.compile(run_scan, backend=mode)
    torch._dynamo.reset()
    x = torch.randn(3, 6, dtype=torch.float64)
    assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                       atol=1e-10, rtol=1e-8)
    assert all(m.lin.weight.grad is None for m in layers)


def _set_frozen(layers_pair, idx, frozen):
    for ls in layers_pair:
        for i in idx:
            ls[i].requires_grad_(not frozen)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_frozen_layers_before_and_after_compiling(backend):
    """Fine-tuning freezes some layers: each trainable layer gets its gradient, a frozen one none,
    whichever layers they are and whether the flags change before or after compiling."""
    plain, layers = pair()
    both = (plain, layers)
    fn = torch.compile(run_scan, backend=backend)
    torch._dynamo.reset()
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)

    def check():
        for ls in both:
            ls.zero_grad(set_to_none=True)
        assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                           atol=1e-10, rtol=1e-8)

    _set_frozen(both, [0], True)  # the first layer frozen: the others still train
    check()
    _set_frozen(both, [1, 2, 3], True)  # all frozen
    check()
    _set_frozen(both, [2], False)  # unfrozen after compiling
    check()
    _set_frozen(both, [0, 1, 3], False)
    _set_frozen(both, [1], True)  # frozen after compiling
    check()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_layers_frozen_when_stacked_train_once_unfrozen(backend):
    """Parameters frozen before ``stack_layers`` (a fine-tuning recipe) get no gradient, and get
    theirs once unfrozen: the stack's graph node leads to every layer's parameter, frozen or not."""
    plain = blocks()
    _set_frozen([plain], [1, 3], True)
    layers = stack_layers(copy.deepcopy(plain))
    both = (plain, layers)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend=backend)
    x = torch.randn(3, 6, dtype=torch.float64)
    for frozen in ([1, 3], [3], []):
        _set_frozen(both, [0, 1, 2, 3], False)
        _set_frozen(both, frozen, True)
        for ls in both:
            ls.zero_grad(set_to_none=True)
        assert_trees_close((step(fn, layers, x), grads(layers)), (step(run_loop, plain, x), grads(plain)),
                           atol=1e-10, rtol=1e-8)
        assert all((p.grad is None) == (i in frozen) for i, layer in enumerate(layers) for p in layer.parameters())


def test_torch_save_and_load_of_the_model_and_the_state_dict():
    plain, layers = pair()
    buf = io.BytesIO()
    torch.save(layers, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(layers)
    assert_views(loaded)
    assert_same_params(loaded, plain)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch._dynamo.reset()
    fn = torch.compile(run_scan, backend="aot_eager")
    assert_trees_close((step(fn, loaded, x), grads(loaded)), (step(run_loop, plain, x), grads(plain)),
                       atol=1e-10, rtol=1e-8)
    buf = io.BytesIO()
    torch.save(layers.state_dict(), buf)
    buf.seek(0)
    fresh = blocks()
    fresh.load_state_dict(torch.load(buf))
    assert_same_params(fresh, plain)


def test_deepcopy_keeps_its_own_stack():
    _, layers = pair()
    twin = copy.deepcopy(layers)
    assert_views(twin)
    assert twin.stacked_parameters()["lin.weight"].data_ptr() != layers.stacked_parameters()["lin.weight"].data_ptr()
    assert_same_params(twin, layers)


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


@pytest.mark.parametrize("container", [torch.nn.ModuleList, torch.nn.Sequential])
@pytest.mark.parametrize("edit", sorted(EDITS))
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


def test_stacking_non_identical_layers_is_a_scan_error_naming_the_layer():
    layers = torch.nn.ModuleList([Block(), Block(), Block(7)])
    with pytest.raises(ScanError, match="layer 2.*lin.weight"):
        stack_layers(layers)
    assert type(layers) is torch.nn.ModuleList
    with pytest.raises(ScanError, match="ModuleList or nn.Sequential"):
        stack_layers(Block())


def test_sequential_and_plain_modulelist_unchanged():
    seq = stack_layers(torch.nn.Sequential(*blocks(3)))
    x = torch.randn(3, 6, dtype=torch.float64)
    assert_trees_close(seq(x), run_loop(blocks(3), x), atol=1e-10, rtol=1e-8)
    assert_views(seq)


def test_xla_values_and_grads_match_the_loop():
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    dev = torch_xla.device()
    plain, layers = pair(dtype=torch.float32)
    layers.to(dev)
    assert all(P.device.type == "xla" for P in layers.stacked_parameters().values())
    x = torch.randn(3, 6)
    want = step(run_loop, plain, x), grads(plain)
    out = step(run_scan, layers, x.to(dev))
    torch_xla.sync()
    got = out.cpu(), [g.cpu() for g in grads(layers)]
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_x = torch.optim.SGD(layers.parameters(), lr=0.1)
    opt_p.step()
    opt_x.step()
    torch_xla.sync()
    assert_trees_close([p.detach().cpu() for p in layers.parameters()], [p.detach() for p in plain.parameters()],
                       atol=1e-5, rtol=1e-4)
    out2 = run_scan(layers, x.to(dev))  # the stack saw the optimizer's update of the views
    torch_xla.sync()
    assert_trees_close(out2.cpu(), run_loop(plain, x).detach(), atol=1e-5, rtol=1e-4)


def test_xla_gradient_rows_are_gathers_and_the_second_step_compiles_nothing():
    """Each layer's gradient is a gathered row (XLA's CPU compiler spends ~5 ms per
    slice output), and the rows made by ``.to(xla)`` are computed at once, so the
    first step's graph is the steady one."""
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    _, layers = pair(dtype=torch.float32)
    layers.to(dev)
    x = torch.randn(3, 6).to(dev)
    compiles = []
    for _ in range(3):
        layers.zero_grad(set_to_none=True)
        run_scan(layers, x).pow(2).sum().backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads(layers))
        before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
        torch_xla.sync()
        compiles.append(met.metric_data("CompileTime")[0] - before)
    assert " gather(" in hlo and " slice(" not in hlo
    assert compiles[0] >= 1 and compiles[1:] == [0, 0]


def test_export_lifts_the_layers_parameters_not_the_stacks():
    plain, layers = pair(depth=3)

    class Model(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            return scan_layers(self.layers, x)

    x = torch.randn(3, 6, dtype=torch.float64)
    ep = torch.export.export(Model(layers), (x,), strict=False)
    assert set(ep.state_dict) == {"layers." + k for k in plain.state_dict()}
    assert not ep.constants
    assert_trees_close(ep.module()(x), run_loop(plain, x), atol=1e-10, rtol=1e-8)


def test_a_dropped_stack_is_freed():
    import gc
    import weakref

    _, layers = pair()
    ref = weakref.ref(layers)
    del layers
    gc.collect()
    assert ref() is None


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
