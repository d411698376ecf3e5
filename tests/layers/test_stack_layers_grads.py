"""stack_layers(grads="stacked"): the stacks are the trained parameters. Checked against the loop
over an unstacked deep copy: each stack's gradient is ``torch.stack`` of the loop's per-layer
gradients, optimizers over ``model.parameters()`` move the same weights, state dicts keep the
unstacked keys."""
import copy
import io
import random

import pytest
import torch
from conftest import assert_trees_close
from decoder import Calling, make_stack, run_loop
from test_stack_layers_random import Block

from torch_scan_hop import ScanError, scan_layers, stack_layers


def pair(depth=4, seed=0, d=5, bias=True, norm=True):
    torch.manual_seed(seed)
    plain = torch.nn.ModuleList(Block(d, bias, norm) for _ in range(depth)).double()
    return plain, stack_layers(copy.deepcopy(plain), grads="stacked")


def run_scan(layers, x):
    return scan_layers(layers, x)


def compiled(backend):
    torch._dynamo.reset()
    return run_scan if backend == "eager" else torch.compile(run_scan, backend=backend)


def stacked_grads(layers):
    return {name: P.grad for name, P in layers.stacked_parameters().items()}


def loop_grads_stacked(plain, names):
    """The loop's per-layer gradients stacked per name (None where no layer has one)."""
    out = {}
    for name in names:
        gs = [layer.get_parameter(name).grad for layer in plain]
        out[name] = None if all(g is None for g in gs) else torch.stack(gs)
    return out


def assert_same_weights(layers, plain, **kw):
    assert list(layers.state_dict()) == list(plain.state_dict())
    assert_trees_close(list(layers.state_dict().values()), list(plain.state_dict().values()), **kw)


def assert_views(layers):
    for name, P in layers.stacked_parameters().items():
        for i, layer in enumerate(layers):
            p = layer.get_parameter(name)
            assert p.untyped_storage().data_ptr() == P.untyped_storage().data_ptr(), (name, i)
            assert p.storage_offset() == P.storage_offset() + i * P.stride(0), (name, i)


def test_stacks_are_registered_parameters_kept_out_of_the_state_dict():
    plain, layers = pair()
    names = [n for n, _ in layers.named_parameters()]
    assert names[:5] == ["stacked__gate", "stacked__lin__weight", "stacked__lin__bias",
                         "stacked__norm__weight", "stacked__norm__bias"]
    assert names[5:] == [n for n, _ in plain.named_parameters()]
    assert layers.stacked_parameters()["lin.weight"] is layers.stacked__lin__weight
    assert list(layers.state_dict()) == list(plain.state_dict())
    assert_views(layers)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_one_gradient_per_name_equal_to_the_loops_stacked(backend):
    plain, layers = pair()
    fn = compiled(backend)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    xl = x.detach().clone().requires_grad_(True)
    for _ in range(2):  # the second backward accumulates
        fn(layers, x).pow(2).sum().backward()
        run_loop(plain, xl).pow(2).sum().backward()
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    got = stacked_grads(layers)
    assert_trees_close((got, x.grad), (loop_grads_stacked(plain, got), xl.grad), atol=1e-9, rtol=1e-7)
    layers.zero_grad()  # model.zero_grad() reaches the stacks: they are its parameters
    assert all(g is None for g in stacked_grads(layers).values())


@pytest.mark.parametrize("opt", ["sgd", "adamw_foreach", "adamw_fused"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_optimizer_over_model_parameters_matches_the_unstacked_copy(opt, backend):
    plain, layers = pair()
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
    }[opt]
    opt_p, opt_s = make(plain.parameters()), make(layers.parameters())
    fn = compiled(backend)
    for _ in range(3):
        x = torch.randn(3, 5, dtype=torch.float64)
        for model, o, f in ((plain, opt_p, run_loop), (layers, opt_s, fn)):
            o.zero_grad()
            f(model, x).pow(2).mean().backward()
            # clipping sees each weight once: the stacks' gradients, no layer .grad beside them
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            o.step()
    assert_same_weights(layers, plain, atol=1e-10, rtol=1e-8)
    assert_views(layers)
    x = torch.randn(3, 5, dtype=torch.float64)
    assert_trees_close(fn(layers, x), run_loop(plain, x), atol=1e-10, rtol=1e-8)


def test_state_dict_round_trips_both_ways_and_strict_load():
    plain, layers = pair()
    other = copy.deepcopy(plain)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    layers.load_state_dict(other.state_dict())  # strict: the stacks' keys are not asked for
    assert_same_weights(layers, other)
    assert_views(layers)
    plain.load_state_dict(layers.state_dict())
    assert_same_weights(plain, other)
    x = torch.randn(2, 5, dtype=torch.float64)
    assert_trees_close(run_scan(layers, x), run_loop(other, x), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_layer_run_directly_trains_through_its_row(backend):
    """Outside scan_layers the layer's own Parameter gets the gradient; it is moved into its row of
    the stack's ``.grad`` (the optimizer trains the stack), the layer keeps no ``.grad``."""
    plain, layers = pair()
    x = torch.randn(2, 5, dtype=torch.float64)
    torch._dynamo.reset()

    def direct(model, x):
        return model[2](x).sum() + model[0](x).pow(2).sum()

    for model in (plain, layers):
        (direct(model, x) if model is plain or backend == "eager"
         else torch.compile(direct, backend=backend)(model, x)).backward()
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    got = stacked_grads(layers)
    want = {n: torch.stack([torch.zeros_like(layer.get_parameter(n)) if layer.get_parameter(n).grad is None
                            else layer.get_parameter(n).grad for layer in plain]) for n in got}
    assert_trees_close(got, want, atol=1e-12, rtol=1e-10)


def test_freezing_a_name_in_all_layers_and_refusing_one_frozen_layer():
    plain, layers = pair()
    x = torch.randn(2, 5, dtype=torch.float64)
    for model in (plain, layers):
        for layer in model:
            layer.lin.weight.requires_grad_(False)
    layers.stacked__lin__weight.requires_grad_(False)
    run_scan(layers, x).sum().backward()
    run_loop(plain, x).sum().backward()
    got = stacked_grads(layers)
    assert got["lin.weight"] is None
    assert_trees_close(got, loop_grads_stacked(plain, got), atol=1e-10, rtol=1e-8)
    layers.requires_grad_(False)
    assert not run_scan(layers, x).requires_grad
    layers.requires_grad_(True)
    layers[1].gate.requires_grad_(False)
    with pytest.raises(ScanError, match=r"layer 1's 'gate' has requires_grad=False"):
        run_scan(layers, x)
    with pytest.raises(ScanError, match=r"layer 1's 'gate' has requires_grad=False"):
        compiled("aot_eager")(layers, x)  # when compiling


def test_a_layer_frozen_after_compiling_is_refused_in_the_backward():
    """The compiled code does not guard the layers' flags: the stack's gradient arrives with a row
    for the frozen layer, and the backward refuses it before any optimizer step could use it."""
    _, layers = pair()
    fn = compiled("aot_eager")
    x = torch.randn(2, 5, dtype=torch.float64)
    fn(layers, x).sum().backward()
    layers.zero_grad()
    layers[3].lin.bias.requires_grad_(False)
    with pytest.raises(ScanError, match=r"layer 3's 'lin.bias' has requires_grad=False"):
        fn(layers, x).sum().backward()
    assert layers.stacked__lin__bias.grad is None


def test_to_deepcopy_and_torch_save_keep_the_registered_stacks():
    _, layers = pair()
    P = layers.stacked__lin__weight
    layers.float()
    assert layers.stacked__lin__weight is P and P.dtype == torch.float32  # an optimizer keeps it
    assert_views(layers)
    for copied in (copy.deepcopy(layers), _saved_and_loaded(layers)):
        assert copied.grads_mode == "stacked"
        fn = compiled("aot_eager")
        fn(copied, torch.randn(2, 5)).sum().backward()
        copied.zero_grad()
        copied[0].gate.requires_grad_(False)  # the copy's own stacks are checked after its backward
        with pytest.raises(ScanError, match="layer 0's 'gate'"):
            fn(copied, torch.randn(2, 5)).sum().backward()
        copied[0].gate.requires_grad_(True)
        copied.zero_grad()
        assert copied.stacked__lin__weight is not P
        assert copied.stacked_parameters()["lin.weight"] is copied.stacked__lin__weight
        assert_views(copied)
        x = torch.randn(2, 5)
        run_scan(copied, x).sum().backward()
        assert copied.stacked__lin__weight.grad is not None and P.grad is None
        assert_trees_close(run_scan(copied, x), run_loop(layers, x))


def _saved_and_loaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_restack_keeps_the_stack_objects_an_optimizer_holds():
    plain, layers = pair()
    opt = torch.optim.SGD(layers.parameters(), lr=0.1)
    new = copy.deepcopy(plain)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(0.5)
    layers.load_state_dict(new.state_dict(), assign=True)  # replaces the layers' Parameters
    before = dict(layers.stacked_parameters())
    layers.restack()
    assert all(layers.stacked_parameters()[n] is P for n, P in before.items())
    x = torch.randn(2, 5, dtype=torch.float64)
    run_scan(layers, x).pow(2).sum().backward()
    opt.step()
    opt_p = torch.optim.SGD(new.parameters(), lr=0.1)
    run_loop(new, x).pow(2).sum().backward()
    opt_p.step()
    assert_same_weights(layers, new, atol=1e-10, rtol=1e-8)


def test_switching_modes_and_a_bad_mode():
    plain, layers = pair()
    stack_layers(layers)  # back to per-layer gradients
    assert not any(n.startswith("stacked__") for n, _ in layers.named_parameters())
    x = torch.randn(2, 5, dtype=torch.float64)
    run_scan(layers, x).sum().backward()
    run_loop(plain, x).sum().backward()
    assert_trees_close([p.grad for p in layers.parameters()], [p.grad for p in plain.parameters()],
                       atol=1e-10, rtol=1e-8)
    with pytest.raises(ScanError, match="grads must be one of"):
        stack_layers(layers, grads="rows")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_functional_call_with_another_stack_uses_it(backend):
    _, layers = pair()
    W = (layers.stacked__lin__weight.detach() * 2).requires_grad_(True)
    x = torch.randn(2, 5, dtype=torch.float64)
    model = Calling(layers, scan_layers)
    torch._dynamo.reset()
    if backend != "eager":
        model.compile(backend=backend)
        model(x)  # compiled with the registered stack first
    got = torch.func.functional_call(model, {"ls.stacked__lin__weight": W}, (x,))
    want_layers = copy.deepcopy(layers)
    with torch.no_grad():
        want_layers.stacked__lin__weight.copy_(W)
    assert_trees_close(got, run_loop(want_layers, x), atol=1e-10, rtol=1e-8)
    got.sum().backward()
    assert W.grad is not None and layers.stacked__lin__weight.grad is None


@pytest.mark.parametrize("seed", range(8))
def test_random_stacks_train_like_the_loop(seed):
    """Random blocks, depth (1 to 5), names frozen whole, backends, optimizers and steps."""
    rng = random.Random(seed)
    depth = rng.randint(1, 5)
    plain, layers = pair(depth, seed, d=rng.choice([3, 5]), bias=rng.random() < 0.7, norm=rng.random() < 0.6)
    d = plain[0].gate.shape[0]
    for name in [n for n, _ in plain[0].named_parameters()]:
        if rng.random() < 0.25:
            for model in (plain, layers):
                for layer in model:
                    layer.get_parameter(name).requires_grad_(False)
            layers.stacked_parameters()[name].requires_grad_(False)
    fn = compiled(["eager", "aot_eager", "aot_eager", "inductor"][seed % 4])
    kind = rng.choice(["sgd", "adamw"])
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if kind == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True))
    opts = make(plain.parameters()), make(layers.parameters())
    for _ in range(rng.randint(1, 3)):
        x = torch.randn(2, d, dtype=torch.float64)
        got, want = fn(layers, x), run_loop(plain, x)
        assert_trees_close(got, want, atol=1e-9, rtol=1e-7)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        g = stacked_grads(layers)
        assert_trees_close(g, loop_grads_stacked(plain, g), atol=1e-9, rtol=1e-7)
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same_weights(layers, plain, atol=1e-9, rtol=1e-7)


def test_xla_one_gradient_output_per_name_and_values_match_the_loop():
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    plain = make_stack(3)
    layers = stack_layers(copy.deepcopy(plain), grads="stacked").to(dev)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_x = torch.optim.SGD(layers.parameters(), lr=0.1)
    compiles = []
    for _ in range(3):
        x = torch.randn(2, 4, 32)
        for model, o, xx in ((plain, opt_p, x), (layers, opt_x, x.to(dev))):
            o.zero_grad(set_to_none=True)
            out = scan_layers(model, xx) if model is layers else run_loop(model, xx)
            out.pow(2).mean().backward()
        gs = [P.grad for P in layers.stacked_parameters().values()]
        assert all(p.grad is None for layer in layers for p in layer.parameters())
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(gs)
        before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
        torch_xla.sync()
        compiles.append(met.metric_data("CompileTime")[0] - before)
        g = {n: P.grad.cpu() for n, P in layers.stacked_parameters().items()}
        assert_trees_close(g, loop_grads_stacked(plain, g), atol=1e-5, rtol=1e-4)
        opt_p.step()
        opt_x.step()
        torch_xla.sync()
    assert " gather(" not in hlo  # no gradient rows handed out
    assert compiles[1:] == [0, 0]
    assert_trees_close([t.cpu() for t in layers.state_dict().values()], list(plain.state_dict().values()),
                       atol=1e-5, rtol=1e-4)


def test_export_runs_the_layers_and_keeps_the_unstacked_state_dict():
    """torch.export stacks per call (its program lifts the layers' parameters); the registered
    stacks are parameters it does not read."""
    plain, layers = pair(depth=3)
    x = torch.randn(2, 5, dtype=torch.float64)
    ep = torch.export.export(Calling(layers, scan_layers), (x,))
    assert_trees_close(ep.module()(x), run_loop(plain, x), atol=1e-10, rtol=1e-8)
    assert set(Calling(plain, scan_layers).state_dict()) <= set(ep.state_dict)


def test_compiled_optimizer_step_trains_the_stacks():
    plain, layers = pair()
    opt_p = torch.optim.AdamW(plain.parameters(), lr=0.01, foreach=True)
    opt_s = torch.optim.AdamW(layers.parameters(), lr=0.01, foreach=True)
    torch._dynamo.reset()
    # both compiled: a compiled AdamW differs from the eager one by ~1e-7 here, unstacked models too
    step_p, step_s = (torch.compile(o.step, backend="aot_eager") for o in (opt_p, opt_s))
    for _ in range(2):
        x = torch.randn(3, 5, dtype=torch.float64)
        run_loop(plain, x).pow(2).mean().backward()
        run_scan(layers, x).pow(2).mean().backward()
        step_p()
        step_s()
        opt_p.zero_grad()
        opt_s.zero_grad()
    assert_same_weights(layers, plain, atol=1e-10, rtol=1e-8)
    assert_views(layers)


def test_an_optimizer_holding_the_layers_but_not_the_stacks_is_refused():
    """Built before stack_layers(grads="stacked") it would hold only the layers' parameters, which
    never get a gradient: its first step names the parameter instead of silently not training."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Block(5, True, True) for _ in range(3)).double()
    early = torch.optim.SGD(layers.parameters(), lr=0.1)
    stack_layers(layers, grads="stacked")
    late = torch.optim.SGD(layers.parameters(), lr=0.1)
    run_scan(layers, torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    with pytest.raises(ScanError, match=r"SGD holds layer 0's 'gate' .*'stacked__gate'"):
        early.step()
    late.step()  # holds the stacks too
    layers.requires_grad_(False)
    layers.restack()
    early.step()  # nothing trains: nothing is lost


def test_a_stack_grouped_apart_from_its_layers_is_refused():
    """Grouping by ``p.dim()`` (no weight decay for biases and norms) puts a layer's bias in one
    group and its stack, one dimension higher, in another: the stack would silently be decayed.
    Per-layer learning rates cannot reach a stack either. Both name the option; groups that agree
    (or that hold the stacks with the layers) train like the loop."""
    torch.manual_seed(0)
    plain = torch.nn.ModuleList(Block(5, True, True) for _ in range(3)).double()
    layers = stack_layers(copy.deepcopy(plain), grads="stacked")

    def by_dim(model):
        ps = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}], lr=0.01)

    run_scan(layers, torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    with pytest.raises(ScanError, match=r"layer 0's 'gate' .* weight_decay=0.0, but its stack 'stacked__gate' "
                                        r".* weight_decay=0.1.*grouping by p.dim\(\)"):
        by_dim(layers).step()
    per_layer_lr = torch.optim.SGD([{"params": list(layer.parameters()), "lr": 0.1 / (i + 1)}
                                    for i, layer in enumerate(layers)] +
                                   [{"params": list(layers.stacked_parameters().values())}], lr=0.1)
    with pytest.raises(ScanError, match=r"layer 1's 'gate' .* lr=0.05, but its stack 'stacked__gate' .* lr=0.1"):
        per_layer_lr.step()
    # what to do: group the stacks by their rows' dimension; a later add_param_group with equal options is fine
    layers.zero_grad()
    stacks = set(map(id, layers.stacked_parameters().values()))

    def fixed(model):
        ps = list(model.parameters())
        rank = [p.dim() - (id(p) in stacks) for p in ps]
        return torch.optim.AdamW([{"params": [p for p, r in zip(ps, rank) if r >= 2], "weight_decay": 0.1},
                                  {"params": [p for p, r in zip(ps, rank) if r < 2], "weight_decay": 0.0}], lr=0.01)

    opts = by_dim(plain), fixed(layers)
    for _ in range(3):
        x = torch.randn(2, 5, dtype=torch.float64)
        for model, o, f in ((plain, opts[0], run_loop), (layers, opts[1], run_scan)):
            f(model, x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert_same_weights(layers, plain, atol=1e-10, rtol=1e-8)
    late = torch.optim.SGD(list(layers[0].parameters()), lr=0.1)
    late.add_param_group({"params": list(layers.stacked_parameters().values())})
    run_scan(layers, torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    late.step()


def test_eager_autograd_sees_the_stacks_and_hooked_layers_still_run_their_hooks():
    """Eager runs the loop over the stacks' rows: ``torch.autograd.grad`` with respect to a
    stack works as compiled (a layer parameter is then unused, as compiled). Layers with module
    hooks run as themselves so the hooks run; their gradients land in the stacks."""
    plain, layers = pair(depth=3)
    x = torch.randn(2, 5, dtype=torch.float64)
    stacks = layers.stacked_parameters()
    got = torch.autograd.grad(run_scan(layers, x).pow(2).sum(), list(stacks.values()))
    run_loop(plain, x).pow(2).sum().backward()
    assert_trees_close(dict(zip(stacks, got)), loop_grads_stacked(plain, stacks), atol=1e-10, rtol=1e-8)
    calls = []
    hook = layers[1].lin.register_forward_hook(lambda *a: calls.append(1))
    run_scan(layers, x).pow(2).sum().backward()
    assert calls == [1]
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert_trees_close(stacked_grads(layers), loop_grads_stacked(plain, stacks), atol=1e-10, rtol=1e-8)
    hook.remove()
    layers.zero_grad()
    layers[2].lin.tag = "last"  # a per-layer attribute: the layers' own code runs (its gradients moved in)
    run_scan(layers, x).pow(2).sum().backward()
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert_trees_close(stacked_grads(layers), loop_grads_stacked(plain, stacks), atol=1e-10, rtol=1e-8)


class NormedBlock(torch.nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d)

    def forward(self, h):
        return h + torch.tanh(self.bn(self.lin(h)))


def test_eager_batchnorm_in_training_mode_runs_the_layers_and_updates_their_stats():
    """Eager is the loop, running statistics included: a BatchNorm in training mode (which a
    traced scan_layers refuses) makes the eager loop run the layers themselves, not the
    stacks' rows; gradients still land in the stacks and each layer updates its own stats."""
    torch.manual_seed(0)
    plain = torch.nn.ModuleList(NormedBlock() for _ in range(3)).double()
    layers = stack_layers(copy.deepcopy(plain), grads="stacked")
    for _ in range(2):
        x = torch.randn(5, 4, dtype=torch.float64)
        out, ref = run_scan(layers, x), run_loop(plain, x)
        out.pow(2).sum().backward()
        ref.pow(2).sum().backward()
        assert_trees_close(out, ref, atol=1e-10, rtol=1e-8)
    stacks = layers.stacked_parameters()
    assert_trees_close(stacked_grads(layers), loop_grads_stacked(plain, stacks), atol=1e-10, rtol=1e-8)
    assert_same_weights(layers, plain, atol=1e-10, rtol=1e-8)  # the running statistics included
    assert int(layers[2].bn.num_batches_tracked) == 2
