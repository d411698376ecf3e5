"""scan_layers: a stack of identical modules as one scan; grads on each layer's own parameters."""
import copy
import functools

import pytest
import torch
from conftest import assert_trees_close
from decoder import DecoderBlock, causal_mask, make_stack, run_loop

import torch_scan_hop
from torch.fx.experimental.proxy_tensor import make_fx
from torch_scan_hop import ScanError, scan_layers

try:
    import torch_xla
except ImportError:
    torch_xla = None


def grads(layers):
    return [p.grad.clone() for p in layers.parameters()]


def train_step(fn, layers, x, mask):
    layers.zero_grad()
    out = fn(layers, x, attn_mask=mask)
    (out.pow(2).mean()).backward()
    return out.detach(), grads(layers)


@pytest.mark.parametrize("remat", ["save_all", "recompute_all"])
def test_decoder_stack_matches_for_loop_forward_and_backward(remat):
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    got = train_step(lambda l, x, **kw: scan_layers(l, x, remat=remat, **kw), layers, x, mask)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)


def test_float64_gradcheck_through_scan_layers_and_input():
    torch.manual_seed(1)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()) for _ in range(3))
    layers = layers.double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    params = list(layers.parameters())

    def f(x, *ps):
        with torch.nn.utils.stateless._reparametrize_module(layers, dict(zip(
                [n for n, _ in layers.named_parameters()], ps))):
            return scan_layers(layers, x)

    assert torch.autograd.gradcheck(f, (x, *params))


def test_multiple_inputs_and_static_kwargs():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, a, b, scale=1.0):
            return torch.tanh(self.lin(a) * scale + b), b * 0.5

    torch.manual_seed(2)
    layers = torch.nn.ModuleList(Pair() for _ in range(4))
    a, b = torch.randn(2, 4), torch.randn(2, 4)
    want = (a, b)
    for layer in layers:
        want = layer(*want, scale=2.0)
    got = scan_layers(layers, a, b, scale=2.0)
    assert isinstance(got, tuple)
    assert_trees_close(got, want, atol=1e-6, rtol=1e-5)


def test_structure_mismatch_names_layer_and_parameter():
    layers = make_stack(3)
    layers[2].fc1 = torch.nn.Linear(32, 64)
    with pytest.raises(ScanError, match=r"layer 2's 'fc1.weight' is \(64, 32\)/torch.float32 but layer 0's is "
                                        r"\(128, 32\)"):
        scan_layers(layers, torch.randn(1, 2, 32))
    layers[2] = torch.nn.Linear(32, 32)
    with pytest.raises(ScanError, match="layer 2 is a Linear, layer 0 a DecoderBlock"):
        scan_layers(layers, torch.randn(1, 2, 32))


def test_eager_is_the_loop_over_the_real_layers_hooks_included():
    layers = make_stack(4)
    seen = []
    handle = layers[2].register_forward_hook(lambda m, args, out: seen.append(m) or out * 0.5)
    try:
        for _ in range(2):  # a new mask tensor every call
            x, mask = torch.randn(2, 5, 32), causal_mask(5) & (torch.rand(5, 5) > 0.2)
            want = train_step(run_loop, layers, x, mask)
            seen.clear()
            got = train_step(lambda l, x, **kw: scan_layers(l, x, **kw), layers, x, mask)
            assert seen == [layers[2]]
            assert_trees_close(got, want, atol=1e-5, rtol=1e-4)
        compiled = torch.compile(lambda l, x: scan_layers(l, x), backend="eager", fullgraph=True)
        with pytest.raises(ScanError, match=r"layer 2 has module hooks"):
            compiled(layers, torch.randn(2, 5, 32))
    finally:
        handle.remove()


class Scaled(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin, self.scale = torch.nn.Linear(3, 3), scale

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.scale


class ScaledDropout(Scaled):
    def __init__(self, scale):
        super().__init__(scale)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, h):
        return self.drop(torch.tanh(self.lin(h)) * self.scale)


class SuperCalling(Scaled):
    def forward(self, h):
        assert isinstance(self, Scaled)
        return super().forward(h) + 1


@pytest.mark.parametrize("mode", ["eager", "make_fx"])
def test_layer_methods_may_call_super(mode):
    layers = torch.nn.ModuleList([SuperCalling(0.5) for _ in range(3)])
    h = torch.randn(2, 3)
    run = (lambda h: scan_layers(layers, h)) if mode == "eager" else make_fx(lambda h: scan_layers(layers, h))(h)
    assert_trees_close(run(h), run_loop(layers, h))


class WrapsForwardInSubclasses(torch.nn.Module):
    """transformers 5's GradientCheckpointingLayer: every subclass's forward is wrapped, and
    the wrapper asks ``type(self).forward is wrapper`` (is it the outermost one?)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        @functools.wraps(forward)
        def outermost_only(self, *args, **kwargs):
            scale = 2.0 if type(self).forward is outermost_only else 1.0  # eager: the layer's own class
            return forward(self, *args, **kwargs) * scale

        cls.forward = outermost_only


class WrappedLayer(WrapsForwardInSubclasses):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, h):
        return torch.tanh(self.lin(h))


@pytest.mark.parametrize("mode", ["compile", "make_fx"])
def test_layer_code_reading_type_self_forward(mode):
    """Traced, the layer's code runs on a view of layer 0, whose type is not the layer's class:
    ``type(self).forward`` must still resolve (it raised AttributeError), and it is not the
    layer class's function, so such a wrapper runs as an inner one (transformers then leaves
    checkpointing to the scan's remat)."""
    layers = torch.nn.ModuleList([WrappedLayer() for _ in range(3)])
    h = torch.randn(2, 3)
    want = h
    for layer in layers:
        want = type(layer).forward.__wrapped__(layer, want)  # the inner forward, as traced
    fn = lambda h: scan_layers(layers, h)  # noqa: E731
    torch._dynamo.reset()
    run = torch.compile(fn, backend="aot_eager", fullgraph=True) if mode == "compile" else make_fx(fn)(h)
    assert_trees_close(run(h), want)


@pytest.mark.parametrize("mode", ["eager", "compile", "make_fx"])
def test_layers_that_differ_in_a_plain_attribute_the_body_reads(mode):
    """Eager runs each real layer (the loop is right); a traced stack runs layer
    0's code, so an attribute that differs is refused, naming layer and attribute."""
    def run(layers, h):
        if mode == "compile":
            torch._dynamo.reset()
            return torch.compile(lambda l, h: scan_layers(l, h), backend="eager", fullgraph=True)(layers, h)
        if mode == "make_fx":
            return make_fx(lambda h: scan_layers(layers, h))(h)(h)
        return scan_layers(layers, h)

    h = torch.randn(2, 3)
    layers = torch.nn.ModuleList([ScaledDropout(1.0), ScaledDropout(1.0), ScaledDropout(2.0)])
    layers[0].unused = "a"  # never read by forward: no reason to refuse
    if mode == "eager":
        assert_trees_close(run(layers, h), run_loop(layers, h))
        return
    with pytest.raises(ScanError, match=r"layer 2's attribute 'scale' is 2.0 but layer 0's is 1.0"):
        run(layers, h)
    layers[2].scale = 1.0
    layers[1].drop.eval()
    with pytest.raises(ScanError, match=r"layer 1's attribute 'drop.training' is False but layer 0's is True"):
        run(layers, h)
    layers[1].drop.train()
    assert_trees_close(run(layers, h), run_loop(layers, h), atol=1e-6, rtol=1e-5)


class CallableAttributes(torch.nn.Module):
    """Callables each layer builds in ``__init__``: a partial, as Hugging Face activations hold
    (``functools.partial(gelu, approximate="tanh")`` in Gemma's and Starcoder2's MLPs), and
    optionally a lambda and a nested def closing over a per-layer value."""

    def __init__(self, approximate="tanh", shift=0.5, closures=True):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.act = functools.partial(torch.nn.functional.gelu, approximate=approximate)
        self.closures = closures
        if closures:
            self.shifted = lambda h: h + shift

            def scaled(h, k=2.0):
                return h * k
            self.scaled = scaled

    def forward(self, h):
        h = self.act(self.lin(h))
        return self.scaled(self.shifted(h)) if self.closures else h


def _run_traced(mode, layers, h, compiled=None):
    if mode == "compile":
        return (compiled or torch.compile(lambda l, h: scan_layers(l, h), backend="eager", fullgraph=True))(layers, h)
    if mode == "make_fx":
        return make_fx(lambda h: scan_layers(layers, h))(h)(h)
    import torch_xla
    dev = torch_xla.device()
    out = scan_layers(layers.to(dev), h.to(dev)).cpu()
    layers.cpu()
    return out


@pytest.mark.parametrize("mode", ["compile", "make_fx", "xla"])
def test_callables_each_layer_builds_alike_are_the_same_attribute(mode):
    """A partial made per layer with equal contents acts as layer 0's: accepted (it was refused
    as 'functools.partial(...) but layer 0's is functools.partial(...)', which kept Gemma and
    Starcoder2 out of scan_layers); one that differs is refused by name, also after a compiled
    call. A lambda or nested def per layer: accepted where its closure can be compared (make_fx,
    XLA), and under torch.compile refused with what to do, as before."""
    if mode == "xla":
        pytest.importorskip("torch_xla")
    torch._dynamo.reset()
    tol = dict(atol=1e-7 if mode == "xla" else 1e-12, rtol=1e-7)
    h = torch.randn(2, 3, dtype=torch.float64)
    layers = torch.nn.ModuleList(CallableAttributes(closures=False) for _ in range(3)).double()
    compiled = torch.compile(lambda l, h: scan_layers(l, h), backend="eager", fullgraph=True)
    assert_trees_close(_run_traced(mode, layers, h, compiled), run_loop(layers, h), **tol)
    layers[2].act = functools.partial(torch.nn.functional.gelu, approximate="none")
    with pytest.raises(ScanError, match=r"layer 2's attribute 'act' is functools.partial"):
        _run_traced(mode, layers, h, compiled)

    layers = torch.nn.ModuleList(CallableAttributes() for _ in range(3)).double()
    if mode == "compile":
        with pytest.raises(ScanError, match=r"'scaled'.*assign one function to every layer"):
            _run_traced(mode, layers, h)
        return
    assert_trees_close(_run_traced(mode, layers, h), run_loop(layers, h), **tol)
    layers[1].shifted = CallableAttributes(shift=1.5).shifted
    with pytest.raises(ScanError, match=r"layer 1's attribute 'shifted'"):
        _run_traced(mode, layers, h)


class NamesLikeTheView(torch.nn.Module):
    """Attributes named like the traced view's own bookkeeping: the view must read the module's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.m, self.state, self.prefix, self.peers, self.parent, self.checked = 2.0, 3.0, 0.5, 1.5, -1.0, 0.25

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.m * self.state + self.prefix * self.peers + self.parent * self.checked


@pytest.mark.parametrize("mode", ["compile", "make_fx", "stacked"])
def test_layer_attributes_named_like_the_views_own_fields(mode):
    layers = torch.nn.ModuleList(NamesLikeTheView() for _ in range(3)).double()
    h = torch.randn(2, 3, dtype=torch.float64)
    want = run_loop(layers, h)
    if mode == "make_fx":
        got = make_fx(lambda h: scan_layers(layers, h))(h)(h)
    else:
        if mode == "stacked":
            torch_scan_hop.stack_layers(layers)
        torch._dynamo.reset()
        got = torch.compile(lambda l, h: scan_layers(l, h), backend="eager", fullgraph=True)(layers, h)
    assert_trees_close(got, want, atol=1e-12, rtol=1e-10)


class NormedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

    def forward(self, h):
        return torch.tanh(self.bn(self.lin(h)))


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("mode", ["eager", "aot_eager", "make_fx"])
def test_batchnorm_updating_running_stats_is_refused_by_name_and_eval_mode_runs(mode, stacked):
    """Training-mode BatchNorm writes its running statistics in place: eager (the loop) updates them
    per layer; traced, that write has nowhere to go and is refused naming the module and its
    buffers. In eval mode the statistics are read-only inputs: values and grads are the loop's."""
    torch.manual_seed(0)
    base = torch.nn.ModuleList(NormedLayer() for _ in range(3)).double()
    for m in base:  # distinct per-layer statistics, so that reading the wrong layer's shows
        m.bn.running_mean.normal_()
        m.bn.running_var.uniform_(0.5, 2.0)
    h = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def run(layers, h):
        if stacked:
            torch_scan_hop.stack_layers(layers)
        if mode == "make_fx":
            return make_fx(lambda h: scan_layers(layers, h))(h)(h)
        if mode == "aot_eager":
            torch._dynamo.reset()
            return torch.compile(lambda l, h: scan_layers(l, h), backend="aot_eager", fullgraph=True)(layers, h)
        return scan_layers(layers, h)

    layers, ref = copy.deepcopy(base), copy.deepcopy(base)
    if mode == "eager":
        assert_trees_close(run(layers, h), run_loop(ref, h))
        assert_trees_close([m.bn.running_mean for m in layers], [m.bn.running_mean for m in ref])
    else:
        with pytest.raises(ScanError, match=r"BatchNorm1d 'bn' of layer 0 is in training mode and updates its "
                                             r"buffers \['running_mean', 'running_var', 'num_batches_tracked'\]"):
            run(layers, h)
    layers.eval(), ref.eval()
    h1, h2 = (h.detach().clone().requires_grad_() for _ in range(2))
    got, want = run(layers, h1), run_loop(ref, h2)
    assert_trees_close(got, want)
    got.sum().backward()  # stacked storage hands its gradient out on backward (not to autograd.grad)
    want.sum().backward()
    assert_trees_close([h1.grad, *grads(layers)], [h2.grad, *grads(ref)])


def test_empty_stack_returns_the_inputs_like_the_loop():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    assert scan_layers(torch.nn.ModuleList(), x) is x
    out = scan_layers([], x, y)
    assert isinstance(out, tuple) and out[0] is x and out[1] is y


def test_torch_compile_matches_loop_and_is_one_scan():
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda l, x, **kw: scan_layers(l, x, **kw), backend=backend, fullgraph=True)
    got = train_step(compiled, layers, x, mask)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-4)
    nodes = graphs[0].graph.nodes
    assert sum(n.target is torch.ops.higher_order.scan for n in nodes) == 1
    # stacked by an op inductor calls rather than generates code for (compile time grew with depth)
    stacks = [n for n in nodes if n.target is torch.ops.torch_scan_hop.stack_weights.default]
    assert len(stacks) == len(list(_state_names(layers)))


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_has_one_scan_over_stacked_weights(strict):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = make_stack(4)

        def forward(self, x, mask):
            return scan_layers(self.layers, x, attn_mask=mask)

    model = Model()
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    ep = torch.export.export(model, (x, mask), strict=strict)
    nodes = list(ep.graph.nodes)
    assert sum(n.target is torch.ops.higher_order.scan for n in nodes) == 1
    # plain aten.stack: the exported program needs none of our ops
    assert sum(n.target is torch.ops.aten.stack.default for n in nodes) == len(list(_state_names(model.layers)))
    assert_trees_close(ep.module()(x, mask), run_loop(model.layers, x, attn_mask=mask), atol=1e-5, rtol=1e-4)


def _state_names(layers):
    yield from (n for n, _ in layers[0].named_parameters())


def test_copies_of_one_layer_are_fine():
    base = DecoderBlock()
    layers = torch.nn.ModuleList(copy.deepcopy(base) for _ in range(3))
    x = torch.randn(1, 3, 32)
    assert_trees_close(scan_layers(layers, x), run_loop(layers, x), atol=1e-5, rtol=1e-4)


def test_xla_matches_cpu_and_grads_land_on_each_layer():
    """torch_xla's test_scan_layers.py::test_decoder_model, on ours: an 8-layer decoder with the
    default unroll is a While, in the output's HLO and in every parameter gradient's."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    dev = torch_xla.device()
    layers = make_stack(8)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    layers_x = copy.deepcopy(layers).to(dev)
    layers_x.zero_grad()
    out = scan_layers(layers_x, x.to(dev), attn_mask=mask.to(dev))
    out.pow(2).mean().backward()
    grads_x = [p.grad for p in layers_x.parameters()]
    for t in [out, *grads_x]:
        one = torch_xla._XLAC._get_xla_tensors_hlo([t])
        assert "while(" in one and "condition=" in one and "body=" in one
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads_x)
    assert hlo.count(" while(") == 2  # forward While + backward While, whatever the depth
    # per-layer gradients are gathered rows: XLA compiles each slice output slowly (O(depth) seconds)
    assert " slice(" not in hlo[hlo.index("ENTRY"):]
    torch_xla.sync()  # one graph for all gradients, not one per .cpu()
    assert_trees_close((out.detach().cpu(), [g.cpu() for g in grads_x]), want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("depth, storage, unroll, whiles",
                         [(2, False, None, 2), (8, False, None, 2), (9, False, None, 2), (8, True, None, 2),
                          (8, False, 8, 0), (8, True, 8, 0)])
def test_xla_default_is_a_while_at_every_depth(depth, storage, unroll, whiles):
    """unroll=None: a forward and a backward While at every depth, stacked storage or not (the HLO
    does not grow with the stack); straight-line code (no While) only when unroll covers every layer."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed")
    torch.manual_seed(depth)
    layers, x = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(depth)), torch.randn(3, 4)
    want = train_step(lambda l, h, **kw: run_loop(l, h), layers, x, None)
    layers_x = copy.deepcopy(layers)
    layers_x = (torch_scan_hop.stack_layers(layers_x) if storage else layers_x).to(torch_xla.device())
    out = scan_layers(layers_x, x.to(torch_xla.device()), unroll=unroll)
    out.pow(2).mean().backward()
    grads = [p.grad for p in layers_x.parameters()]
    assert torch_xla._XLAC._get_xla_tensors_hlo(grads).count(" while(") == whiles
    assert_trees_close((out.detach().cpu(), [g.cpu() for g in grads]), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_torch_compile_backends_train_like_the_loop(backend):
    layers = make_stack(4)
    x, mask = torch.randn(2, 5, 32), causal_mask(5)
    want = train_step(run_loop, layers, x, mask)
    torch._dynamo.reset()
    compiled = torch.compile(lambda l, x, **kw: scan_layers(l, x, **kw), backend=backend, fullgraph=True)
    assert_trees_close(train_step(compiled, layers, x, mask), want, atol=1e-5, rtol=1e-4)


class MHABlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, h, mask=None):
        return h + self.mha(h, h, h, attn_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("mode", ["eager", "aot_eager", "make_fx"])
def test_attention_mask_is_a_constant_not_a_differentiable_carry(mode):
    """Tensor keyword inputs are per-call constants: nothing asks for a
    gradient of the mask (SDPA's CPU kernel has none)."""
    torch.manual_seed(3)
    layers = torch.nn.ModuleList(MHABlock() for _ in range(3))
    h, mask = torch.randn(2, 5, 8), torch.triu(torch.full((5, 5), float("-inf")), 1)
    run = {
        "eager": lambda ls, h, mask: scan_layers(ls, h, mask=mask),
        "aot_eager": torch.compile(lambda ls, h, mask: scan_layers(ls, h, mask=mask), backend="aot_eager"),
        "make_fx": lambda ls, h, mask: make_fx(lambda h, mask: scan_layers(ls, h, mask=mask))(h, mask)(h, mask),
    }[mode]
    torch._dynamo.reset()
    assert_trees_close(train_step(lambda l, x, attn_mask: run(l, x, attn_mask), layers, h, mask),
                       train_step(lambda l, x, attn_mask: run_loop(l, x, mask=attn_mask), layers, h, mask),
                       atol=1e-5, rtol=1e-4)


class _Sinusoid(torch.nn.Module):
    """GPT-J's attention keeps its position table as a plain tensor attribute built per layer."""

    def __init__(self, as_buffer):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        table = torch.sin(torch.arange(12.0)).reshape(3, 4)  # alike in every layer
        if as_buffer:
            self.register_buffer("table", table, persistent=False)
        else:
            self.table = table

    def forward(self, h):
        return torch.tanh(self.lin(h) + self.table)


@pytest.mark.parametrize("as_buffer", [False, True])
def test_a_plain_tensor_attribute_per_layer_is_named_with_the_buffer_fix(as_buffer):
    """Under torch.compile a plain tensor attribute made per layer (alike, other objects) is a
    ScanError that names it and says to register it as a buffer; as a buffer it runs as the loop."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Sinusoid(as_buffer) for _ in range(3))
    h = torch.randn(3, 4)
    f = torch.compile(lambda h: scan_layers(layers, h), backend="aot_eager", fullgraph=True)
    if not as_buffer:
        with pytest.raises(ScanError, match=r"layer 1's attribute 'table' is a plain tensor .* alike .*"
                                            r"register_buffer\('table', t, persistent=False\)"):
            f(h)
        return
    assert_trees_close(f(h), run_loop(layers, h))


@pytest.mark.parametrize("case", ["shapes", "not_a_module", "no_input"])
def test_call_errors_are_scan_errors_under_fullgraph(case):
    """scan_layers' checks of the call (module elements, an input, layer structure) raise in Python
    that Dynamo traces: under fullgraph that was Dynamo's "Observed exception"; now the ScanError."""
    torch._dynamo.reset()
    layers = {"shapes": [torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)],
              "not_a_module": [torch.nn.Linear(4, 4), torch.tanh], "no_input": [torch.nn.Linear(4, 4)]}[case]
    call = (lambda h: scan_layers(layers)) if case == "no_input" else (lambda h: scan_layers(layers, h))
    with pytest.raises(ScanError) as eager:
        call(torch.zeros(2, 4))
    with pytest.raises(ScanError) as compiled:
        torch.compile(call, backend="eager", fullgraph=True)(torch.zeros(2, 4))
    assert str(compiled.value).splitlines()[0] == str(eager.value).splitlines()[0]
