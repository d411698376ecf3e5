"""Hugging Face transformers layers through scan_layers, against the model's own loop.

Tiny random configs built offline (no download): GPT2 blocks and BERT layers (which return
``(hidden_states, attn_weights)``), Llama decoder layers (a plain tensor; rotary embeddings and
grouped-query attention), BART decoder layers (an encoder-decoder: cross-attention on the
encoder's output; ``(hidden, self_attn, cross_attn)``) and Qwen2-MoE decoder layers
(``(hidden, router_logits)``, for an auxiliary router loss).

The keyword inputs every layer gets (masks, rotary embeddings, the encoder's states) are the
ones the model itself passes to its layer 0, captured by a hook in one run of the model; the
reference is the model's loop over its layers with them, checked once against the model's own
outputs (last layer, attentions, router logits). Values and gradients (of parameters and
inputs) are compared in eager, under torch.compile (inductor), through torch.export and on XLA,
and optimizer steps on stack_layers storage against an unstacked copy.
"""
import copy
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _isolated  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from conftest import assert_trees_close  # noqa: E402
from test_model_zoo import fresh, value_and_grads  # noqa: E402

from torch_scan_hop import ScanError, _compat, scan_layers, stack_layers  # noqa: E402

transformers = pytest.importorskip("transformers")
# transformers 5: layers return the hidden state alone; attention weights, hidden states and
# router logits are recorded by forward hooks the model installs on its first call asking for them
V5 = int(transformers.__version__.split(".")[0]) >= 5

B, T, D, V = 2, 5, 16, 32
TOL = dict(rtol=1e-4, atol=1e-5)
SMALL = dict(vocab_size=V, attn_implementation="eager")  # eager attention returns its weights


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=D, n_head=2, n_positions=T, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, **SMALL)
    return transformers.GPT2Model(cfg), lambda m: m.h, dict(output_attentions=True), lambda o: (o.attentions,)


def _bert():
    cfg = transformers.BertConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=T, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  **SMALL)
    return (transformers.BertModel(cfg, add_pooling_layer=False), lambda m: m.encoder.layer,
            dict(output_attentions=True), lambda o: (o.attentions,))


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=T, **SMALL)
    return transformers.LlamaModel(cfg), lambda m: m.layers, {}, None


def _bart():
    cfg = transformers.BartConfig(d_model=D, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                  max_position_embeddings=T, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, **SMALL)
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(2))
    return (transformers.BartModel(cfg), lambda m: m.decoder.layers,
            dict(decoder_input_ids=ids, output_attentions=True),
            lambda o: (o.decoder_attentions, o.cross_attentions))


def _qwen2_moe(**experts):
    """``experts``: ``experts_implementation=...`` (transformers 5), else its default ("grouped_mm")."""
    cfg = transformers.Qwen2MoeConfig(hidden_size=D, intermediate_size=32, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=T, **SMALL, **experts)
    return (transformers.Qwen2MoeModel(cfg), lambda m: m.layers,
            dict(output_router_logits=True), lambda o: (o.router_logits,))


def _llama_heads_split():
    """Llama with as many key/value heads as query heads, for the sharded checks (``_hf_sharded``,
    ``spmd_hf_cases``): tensor parallelism splits heads over devices, and one key/value head
    (``_llama``'s grouped-query attention) cannot be split."""
    cfg = transformers.LlamaConfig(hidden_size=D, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=T, **SMALL)
    return transformers.LlamaModel(cfg), lambda m: m.layers, {}, None


# name -> (model, its layers, keywords for the model call, the model's own per-layer outputs)
MODELS = {"gpt2": _gpt2, "bert": _bert, "llama": _llama, "bart": _bart, "qwen2_moe": _qwen2_moe}
SHARDED_ONLY = {"llama_tp": _llama_heads_split}  # built by name, not run by this file's tests
TRACEABLE = ["gpt2", "bert", "llama", "bart"]  # Qwen2-MoE routes tokens with nonzero(): data-dependent shapes


def own_loop(layers, h, kw):
    """The models' loop: ``h = layer(h, ...)[0]``, each layer's other outputs collected and stacked."""
    extras = []
    for layer in layers:
        out = layer(h, **kw)
        if isinstance(out, tuple):
            h = out[0]
            extras.append(out[1:])
        else:
            h = out
    if not extras:
        return h
    return (h,) + tuple(None if col[0] is None else torch.stack(col) for col in zip(*extras))


class Stack(torch.nn.Module):
    """The model's layers with the keywords it gives them: tensors as inputs, the rest fixed."""

    def __init__(self, layers, static):
        super().__init__()
        self.layers, self.static = layers, static

    def forward(self, h, tensors):
        return scan_layers(self.layers, h, **tensors, **self.static)

    def loop(self, h, tensors):
        return own_loop(self.layers, h, {**tensors, **self.static})


def _captured(model, layers, call):
    """(hidden state, keywords) layer 0 gets from the model, and the model's output with the last
    layer's output: one run with hooks (removed after: a traced scan_layers refuses hooks)."""
    seen = {}
    sig = inspect.signature(type(layers[0]).forward)

    def pre(module, args, kwargs):
        bound = sig.bind(module, *args, **kwargs).arguments
        bound.pop("self")
        bound.update(bound.pop("kwargs", {}))
        seen["h"], seen["kw"] = bound.pop(next(iter(bound))), bound

    def post(module, args, out):
        seen["last"] = out

    handles = [layers[0].register_forward_pre_hook(pre, with_kwargs=True), layers[-1].register_forward_hook(post)]
    try:
        with torch.no_grad():
            out = model(**call)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out


def build(name, **options):
    """(Stack, inputs, the model's own (last layer output, per-layer outputs)) for a fresh seeded model
    (``options``: its factory's)."""
    torch.manual_seed(0)
    model, get_layers, call, own = {**MODELS, **SHARDED_ONLY}[name](**options)
    model.eval()
    pad = torch.ones(B, T, dtype=torch.long)
    pad[1, -2:] = 0  # the second sequence ends in two padding positions
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))
    seen, out = _captured(model, get_layers(model), dict(input_ids=ids, attention_mask=pad, use_cache=False, **call))
    tensors = {k: v for k, v in seen["kw"].items() if pytree.tree_leaves(v) and all(
        isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v))}
    static = {k: v for k, v in seen["kw"].items() if k not in tensors}
    tensors = pytree.tree_map(lambda t: t.detach().clone(), tensors)
    if "encoder_hidden_states" in tensors:  # the encoder's output: its gradient is checked too
        tensors["encoder_hidden_states"].requires_grad_()
    h = seen["h"].detach().clone().requires_grad_()
    return Stack(get_layers(model), static), (h, tensors), (seen["last"], None if own is None else own(out))


@pytest.mark.parametrize("name", list(MODELS))
def test_the_reference_loop_is_the_models_own(name):
    stack, inputs, (last, own) = build(name)
    with torch.no_grad():
        got = stack.loop(*inputs)
    if own is None or V5:
        assert_trees_close(got, last, **TOL)
        return
    assert_trees_close(got[0], last[0], **TOL)
    assert_trees_close(got[1:], tuple(torch.stack(o) for o in own), **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_eager(name):
    stack, inputs, _ = build(name)
    got = value_and_grads(stack, stack, inputs)
    assert isinstance(got[0], tuple) == (name != "llama" and not V5)  # Llama returns a tensor: today's form
    assert_trees_close(got, value_and_grads(stack, stack.loop, fresh(inputs)), **TOL)


@pytest.mark.parametrize("name", TRACEABLE)
def test_export(name):
    stack, inputs, _ = build(name)
    ep = torch.export.export(stack, pytree.tree_map(torch.Tensor.detach, inputs))
    with torch.no_grad():
        assert_trees_close(ep.module()(*fresh(inputs)), stack.loop(*inputs), **TOL)


class Stacks(torch.nn.Module):
    """Several models' stacks in one module: one torch.compile for them all (inductor compiles a
    forward and a backward, ~20-40 s each on 2 CPU cores: sharing them keeps this file lean)."""

    def __init__(self, stacks):
        super().__init__()
        self.stacks = torch.nn.ModuleList(stacks)

    def forward(self, *inputs):
        return tuple(s(*i) for s, i in zip(self.stacks, inputs))

    def loop(self, *inputs):
        return tuple(s.loop(*i) for s, i in zip(self.stacks, inputs))


def test_inductor():
    """GPT2 (attention weights stacked), BART's decoder (two extras; a gradient through the
    encoder's states every layer cross-attends to) and Llama (rotary embeddings, a plain-tensor
    output) compiled together."""
    torch._dynamo.reset()
    built = [build(name) for name in ("gpt2", "bart", "llama")]
    model, inputs = Stacks([b[0] for b in built]), tuple(b[1] for b in built)
    # transformers 5: called as its model's forward calls it, nothing collected (the hooks installed
    # by build(); Dynamo before 2.15 cannot read the collector alone: test_capture_hooks)
    compiled = torch.compile(Collecting(model, []) if V5 else model, backend="inductor", fullgraph=True)
    got = value_and_grads(model, compiled, inputs)
    assert_trees_close(got, value_and_grads(model, model.loop, fresh(inputs)), **TOL)


def test_compiled_fullgraph():
    """BERT (its layer counts the parameters of ``self.feed_forward_chunk``, a method bound to
    the body's view: ``inspect.signature`` under Dynamo, which torch before 2.15 could not
    trace for a ``functools.partial``) and, on transformers 5, Qwen2-MoE (its experts route
    without data-dependent shapes when traced: "grouped_mm", or on transformers 5.17, after the
    refusal, "batched_mm") under torch.compile(fullgraph=True), compiled together: the loop's
    values and gradients. (GPT2, BART and Llama: test_inductor.)"""
    torch._dynamo.reset()
    experts = {}
    if V5 and _compat.transformers.grouped_mm_backward_reads_values():
        # transformers 5.17: Qwen2-MoE's default experts ("grouped_mm") fall back, compiled in float32, to a grouped
        # matmul whose backward reads .tolist() (layers.experts): refused by name; the implementation named traces
        with pytest.raises(ScanError, match=r"'grouped_mm'.*set_experts_implementation\(\"batched_mm\"\)"):
            _compiled_fullgraph({})
        torch._dynamo.reset()
        experts = dict(experts_implementation="batched_mm")
    _compiled_fullgraph(experts)


def _compiled_fullgraph(experts):
    built = [build("bert")] + ([build("qwen2_moe", **experts)] if V5 else [])
    model, inputs = Stacks([b[0] for b in built]), tuple(b[1] for b in built)
    compiled = torch.compile(Collecting(model, []) if V5 else model, backend="aot_eager", fullgraph=True)
    got = value_and_grads(model, compiled, inputs)
    assert_trees_close(got, value_and_grads(model, model.loop, fresh(inputs)), **TOL)


@pytest.mark.parametrize("name", TRACEABLE)
def test_xla(name):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    _isolated.call("test_hf_layers", "check_xla", name)  # in a child interpreter: a crash fails only this case


def check_xla(name):
    import torch_xla
    dev = torch_xla.device()
    stack, inputs, _ = build(name)
    want = value_and_grads(stack, stack.loop, fresh(inputs))
    stack = copy.deepcopy(stack).to(dev)
    inputs = pytree.tree_map(lambda t: t.detach().to(dev).requires_grad_(t.requires_grad), inputs)
    got = value_and_grads(stack, stack, inputs)
    torch_xla.sync()  # one graph for every output and gradient (each .cpu() alone compiles its own)
    assert_trees_close(pytree.tree_map(lambda t: t if t is None else t.detach().cpu(), got), want, **TOL)


def _loss(out):
    """A fixed weighting of the hidden state, plus the mean of every extra (a router loss, say)."""
    h, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    return (h * w).sum() + sum(e.float().pow(2).mean() for e in extras if e is not None)


@pytest.mark.parametrize("grads", ["per_layer", "stacked"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "qwen2_moe"])
def test_adamw_on_stacked_storage(name, grads):
    """stack_layers(...) + AdamW: the same weights after a few steps as the unstacked model looping.
    Under grads="stacked" a stack has one gradient for all its layers: an expert no token was routed
    to in one layer has a zero row there, where the plain layer has no gradient at all (and AdamW
    would skip it, weight decay included): the plain copy is given those zeros."""
    plain, inputs, _ = build(name)
    stacked = copy.deepcopy(plain)
    stack_layers(stacked.layers, grads=grads)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, foreach=True) for m in (plain, stacked)]
    for _ in range(3):
        for m, opt, fn in ((plain, opts[0], plain.loop), (stacked, opts[1], stacked)):
            opt.zero_grad()
            _loss(fn(*fresh(inputs))).backward()
            if m is plain and grads == "stacked":
                for p in m.parameters():
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            opt.step()
    assert list(stacked.layers.state_dict()) == list(plain.layers.state_dict())
    assert_trees_close(list(stacked.layers.state_dict().values()), list(plain.layers.state_dict().values()), **TOL)
    assert_trees_close(stacked(*inputs), plain.loop(*inputs), **TOL)


class Returns(torch.nn.Module):
    """A layer returning ``make(h)``."""

    def __init__(self, make):
        super().__init__()
        self.lin, self.make = torch.nn.Linear(4, 4), make

    def forward(self, h):
        return self.make(self.lin(h))


@pytest.mark.parametrize("make, match", [
    (lambda h: (h.sum(-1), h), r"layer 0 \(Returns\) returns \(Tensor\(2,\), Tensor\(2, 4\)\), which does not "
                               r"match its input Tensor\(2, 4\)"),
    (lambda h: (h, "cache"), r"layer 0 \(Returns\) returns \(Tensor\(2, 4\), str\); element 1 is str"),
])
@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_an_output_that_does_not_match_the_input_is_a_scan_error(make, match, mode):
    layers = torch.nn.ModuleList(Returns(make) for _ in range(2))
    fn = (lambda x: scan_layers(layers, x)) if mode == "eager" else torch.compile(
        lambda x: scan_layers(layers, x), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(ScanError, match=match):
        fn(torch.randn(2, 4))


class WithExtras(torch.nn.Module):
    """``(a, b) -> (a', b', None, aux loss)``: two carried inputs, a None, a scalar per layer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, a, b):
        a = torch.tanh(self.lin(a) + b)
        return a, b * 2, None, a.pow(2).mean()


@pytest.mark.parametrize("mode", ["eager", "aot_eager"])
def test_several_inputs_a_none_and_a_per_layer_loss(mode):
    layers = torch.nn.ModuleList(WithExtras() for _ in range(3))
    fn = (lambda a, b: scan_layers(layers, a, b)) if mode == "eager" else torch.compile(
        lambda a, b: scan_layers(layers, a, b), backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    inputs = (torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True))
    got = value_and_grads(layers, fn, inputs)
    assert got[0][2] is None and got[0][3].shape == (3,)  # the losses of the 3 layers
    assert_trees_close(got, value_and_grads(layers, lambda a, b: own_loop_n(layers, a, b), fresh(inputs)), **TOL)


def own_loop_n(layers, a, b):
    losses = []
    for layer in layers:
        a, b, _, loss = layer(a, b)
        losses.append(loss)
    return a, b, None, torch.stack(losses)


def test_layers_returning_different_forms_are_a_scan_error():
    layers = torch.nn.ModuleList([Returns(lambda h: (h, h.sum())), Returns(lambda h: (h,))])
    with pytest.raises(ScanError, match=r"layer 1 \(Returns\) returns extras \(\) where layer 0 returns extras \(Tensor,\)"):
        scan_layers(layers, torch.randn(2, 4))
    layers = torch.nn.ModuleList([Returns(lambda h: (h, h.sum())), Returns(lambda h: h)])
    with pytest.raises(ScanError, match=r"layer 1 \(Returns\) returns the hidden state alone where layer 0 returns"):
        scan_layers(layers, torch.randn(2, 4))


@pytest.mark.skipif(V5, reason="transformers 5 picks a traceable experts implementation when traced: "
                    "test_moe_experts_traced")
def test_data_dependent_routing_is_a_clear_error_when_traced():
    """Qwen2-MoE routes tokens with nonzero() (data-dependent shapes): eager runs it (above); traced,
    it is a ScanError that says why, not a failure deep inside torch."""
    stack, inputs, _ = build("qwen2_moe")
    with pytest.raises(ScanError, match="data-dependent|value of a tensor"):
        torch.export.export(stack, pytree.tree_map(torch.Tensor.detach, inputs))
    torch._dynamo.reset()
    with pytest.raises(ScanError, match="nonzero"):
        torch.compile(stack, backend="aot_eager")(*inputs)


@pytest.mark.skipif(not V5, reason="transformers 4 routes with nonzero() when traced too: "
                    "test_data_dependent_routing_is_a_clear_error_when_traced")
def test_moe_experts_traced():
    """transformers 5's Qwen2-MoE experts run without data-dependent shapes when traced: the
    exported stack gives the loop's values."""
    stack, inputs, _ = build("qwen2_moe")
    ep = torch.export.export(stack, pytree.tree_map(torch.Tensor.detach, inputs))
    with torch.no_grad():
        assert_trees_close(ep.module()(*fresh(inputs)), stack.loop(*inputs), **TOL)


def _collecting(keys):
    """transformers 5's collector as a model's forward sets it around its layers' loop."""
    from transformers.utils import output_capturing
    return output_capturing._active_collector, {k: [] for k in keys}


class Collecting(torch.nn.Module):
    """What transformers 5's ``capture_outputs`` does around a model's forward: the collector
    of ``keys`` set (compiled: in a plain attribute Dynamo reads) while the stack runs, and
    what it collected returned with the stack's output."""

    def __init__(self, stack, keys):
        super().__init__()
        self.stack, self.keys = stack, keys

    def forward(self, *inputs):
        var, collector = _collecting(self.keys)
        token = var.set(collector)
        try:
            out = self.stack(*inputs)
        finally:
            var.reset(token)
        return out if not self.keys else (out, tuple(tuple(collector[k]) for k in self.keys))


@pytest.mark.skipif(not V5, reason="transformers 4 has no output-capturing hooks: its layers return "
                    "their attentions (test_eager, test_export)")
@pytest.mark.parametrize("name", ["gpt2", "bart", "qwen2_moe"])
def test_capture_hooks(name):
    """The model's first call asking for attentions (router logits) installed forward hooks on
    every layer and attention module, which record while a model collects. Eager scan_layers
    is the loop, hooks and all; traced, the body records what each collecting hook is given
    and the hooks run after the scan, layer by layer: the model's lists come out as the
    loop's (values and gradients through them), under export, compile and compiled whole."""
    stack, inputs, (_, own) = build(name)
    assert any(len(m._forward_hooks) for m in stack.layers.modules())
    keys = {"gpt2": ["attentions", "hidden_states"], "bart": ["attentions", "cross_attentions"],
            "qwen2_moe": ["router_logits"]}[name]
    model = Collecting(stack, keys)
    loop = Collecting(Loop(stack), keys)
    with torch.no_grad():
        (_, got) = model(*inputs)
    for k, o in zip(keys, own if name != "gpt2" else own + (None,)):
        if o is not None:
            assert_trees_close(got[keys.index(k)], tuple(o), **TOL)  # eager: the model's own outputs
    want = value_and_grads(loop, loop, fresh(inputs))
    ep = torch.export.export(model, pytree.tree_map(torch.Tensor.detach, inputs))
    with torch.no_grad():
        assert_trees_close(ep.module()(*fresh(inputs)), want[0], **TOL)
    if name != "qwen2_moe":  # routing under compile: test_compiled_fullgraph
        torch._dynamo.reset()
        assert_trees_close(value_and_grads(model, torch.compile(model, backend="aot_eager"), inputs), want, **TOL)
    if _compat.dynamo.guards_context_vars():  # alone, the collector is a ContextVar: read and guarded
        torch._dynamo.reset()
        compiled = torch.compile(stack, backend="aot_eager")
        idle = value_and_grads(stack, compiled, inputs)
        assert_trees_close(idle, value_and_grads(stack, stack.loop, fresh(inputs)), **TOL)
        var, collector = _collecting(keys)
        token = var.set(collector)
        try:
            compiled(*fresh(inputs))  # the same compiled function: not the idle graph again
        finally:
            var.reset(token)
        assert_trees_close(tuple(tuple(collector[k]) for k in keys), want[0][1], **TOL)
    else:
        torch._dynamo.reset()
        with pytest.raises(ScanError, match="cannot read whether a model collects"):
            torch.compile(stack, backend="aot_eager")(*inputs)


@pytest.mark.skipif(not V5, reason="transformers 4 has no output-capturing hooks")
def test_capture_hooks_on_stacked_storage():
    """As test_capture_hooks, the layers on stack_layers storage (under Dynamo the hooks are then
    found through the container's token, once): compiled while collecting, the loop's lists."""
    stack, inputs, _ = build("gpt2")
    keys = ["attentions", "hidden_states"]
    loop = Collecting(Loop(stack), keys)
    want = value_and_grads(loop, loop, fresh(inputs))
    stacked = copy.deepcopy(stack)
    stack_layers(stacked.layers)
    model = Collecting(stacked, keys)
    torch._dynamo.reset()
    got = value_and_grads(model, torch.compile(model, backend="aot_eager"), fresh(inputs))
    assert_trees_close(got, want, **TOL)


class Loop(torch.nn.Module):
    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, *inputs):
        return self.stack.loop(*inputs)


@pytest.mark.skipif(not V5, reason="transformers 4 has no output-capturing hooks")
def test_capture_hooks_xla():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    _isolated.call("test_hf_layers", "check_capture_xla", "gpt2")  # in a child interpreter


def check_capture_xla(name):
    """test_capture_hooks on XLA: attentions and hidden states collected through a traced
    scan_layers (one While), values and gradients as the loop's on the CPU."""
    import torch_xla
    dev = torch_xla.device()
    stack, inputs, _ = build(name)
    keys = ["attentions", "hidden_states"]
    loop = Collecting(Loop(stack), keys)
    want = value_and_grads(loop, loop, fresh(inputs))
    model = Collecting(copy.deepcopy(stack).to(dev), keys)
    inputs = pytree.tree_map(lambda t: t.detach().to(dev).requires_grad_(t.requires_grad), inputs)
    got = value_and_grads(model, model, inputs)
    torch_xla.sync()
    assert len(got[0][1][0]) == len(stack.layers) and len(got[0][1][1]) == len(stack.layers) + 1
    assert_trees_close(pytree.tree_map(lambda t: t if t is None else t.detach().cpu(), got), want, **TOL)
