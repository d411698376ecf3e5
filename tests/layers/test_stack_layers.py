"""stack_layers: stacked parameter storage, checked against an unstacked deep copy."""
import copy
import io

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from conftest import assert_trees_close, capture_graphs
from decoder import causal_mask, make_stack, run_loop

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
