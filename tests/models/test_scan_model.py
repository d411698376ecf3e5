"""scan_model: a transformers model's decoder stack as scans, against its unscanned twin.

Every family of ``hf_families`` (tiny random configs, float32, CPU): the plan (one scan per run
of identical layers, one scan over blocks of a repeating pattern), logits, loss and every
parameter's gradient in eager and under torch.compile (aot_eager; inductor for Gemma 3), greedy
generate() with the default cache, a static cache and no cache, weights saved and loaded, and
the errors for models it cannot scan.
"""
import copy
import os
import pickle

import pytest
import torch
from hf_families import ALIKE, FAMILIES, PLANS, build, ids, logits_and_loss

from torch_scan_hop import ScanError, _compat, scan_model
from torch_scan_hop.models import scan_plan

pytest.importorskip("transformers", minversion="5")
TOL = dict(rtol=1e-4, atol=1e-5)
SLOW_INDUCTOR = ["gemma3"]  # by hand also: every other family (README; ~1 min each on 2 cores)
# compiled, Gemma 3 keeps its shape (blocks of sliding layers and a full one, then a leftover layer) at half
# the depth: 7 layers, a full one every 3 (2 blocks of 3 + 1); 14 layers of 5:1 took ~4 min under inductor
COMPILED_SHAPE = {"gemma3": dict(layers=7, full_every=3)}


def _twins(family, **shape):
    torch.manual_seed(0)
    ref = build(family, **shape)
    scanned = scan_model(copy.deepcopy(ref))
    return ref, scanned


def _step(model, f=logits_and_loss, tokens=None):
    model.train()
    logits, loss = f(model, ids() if tokens is None else tokens)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return logits, loss, grads


def _assert_step_close(got, want):
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    for i, (g, w) in enumerate(zip(got[2], want[2])):
        assert (g is None) == (w is None), f"parameter {i}: gradient presence differs"
        if g is not None:
            torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_and_state_unchanged(family):
    ref, scanned = _twins(family)
    assert scan_plan(scanned) == PLANS[family]
    assert list(scanned.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in scanned.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert scan_model(scanned) is scanned  # a second call changes nothing


def test_gemma3_at_its_real_depth_is_one_scan_over_blocks_and_one_over_the_rest():
    assert scan_plan(scan_model(build("gemma3", 26))) == [
        "layers 0-25: " + ALIKE.format(n=26),
        "layers 0-23: one scan over 4 blocks of 6 layers", "layers 24-25: one scan over 2 layers"]
    assert scan_plan(scan_model(build("gemma3", 7, full_every=3))) == [
        "layers 0-6: " + ALIKE.format(n=7), "layers 0-5: one scan over 2 blocks of 3 layers", "layer 6: called as it is"]


# Qwen3-Next's body (its gated delta rule loops over chunks) takes ~2-5 minutes to trace on 2 cores:
# compiled only with SCAN_SLOW_MODELS=1 (passed by hand on torch 2.9, 2026-11-28), to keep CI in budget
SLOW_TRACE = {"qwen3_next"}


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_eager_and_compiled(family, fresh_dynamo):
    ref, scanned = _twins(family, **COMPILED_SHAPE.get(family, {}))
    if family in SLOW_TRACE and os.environ.get("SCAN_SLOW_MODELS") != "1":
        _assert_step_close(_step(scanned), _step(ref))
        pytest.skip(f"eager checked; compiled {family} runs with SCAN_SLOW_MODELS=1 (minutes of tracing)")
    want = _step(ref)
    _assert_step_close(_step(scanned), want)
    if family in MOE and _compat.transformers.grouped_mm_backward_reads_values():
        want = _refused_then_batched_mm(ref, scanned)
    graphs, backend = _aot_eager_recording()
    _assert_step_close(_step(scanned, torch.compile(logits_and_loss, backend=backend, fullgraph=True)), want)
    scans = [n for gm in graphs for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]
    plan = scan_plan(scanned)  # one scan over layers of several kinds, else one per line of the plan
    assert len(scans) == (1 if "kinds" in plan[0] else sum("scan" in line for line in plan))  # in the forward graph


# mixture-of-experts families: their experts run transformers' default implementation, "grouped_mm", which under
# torch.compile with float32 weights falls back to transformers' own grouped matmul. Its backward traces where
# transformers made it an op (5.24); where it is Python reading .tolist() (5.17) a compiled scanned training step
# is refused with the implementation that traces (layers.experts), which the test then sets on both models
MOE = {"gpt_oss", "mixtral", "qwen3_next"}


def _refused_then_batched_mm(ref, scanned):
    """The refusal naming the experts and the fix; then the fix on both models: the reference step."""
    with pytest.raises(ScanError, match=r"'grouped_mm'.*\.tolist\(\).*set_experts_implementation\(\"batched_mm\"\)"):
        _step(scanned, torch.compile(logits_and_loss, backend="aot_eager", fullgraph=True))
    for model in (ref, scanned):
        model.set_experts_implementation("batched_mm")
    want = _step(ref)
    _assert_step_close(_step(scanned), want)
    return want


def test_an_experts_implementation_that_reads_the_routing_is_refused_by_name(fresh_dynamo):
    """Every transformers 5: the "eager" experts loop over the experts hit (nonzero()) in a
    compiled scan is a ScanError naming the experts module and the implementation that traces
    (the loop's values otherwise: eager, the scan is the loop)."""
    ref, scanned = _twins("mixtral")
    for model in (ref, scanned):
        model.set_experts_implementation("eager")
    _assert_step_close(_step(scanned), _step(ref))
    with pytest.raises(ScanError, match=r"experts module 'mlp.experts' \(MixtralExperts\) runs "
                         r"transformers' experts implementation 'eager'.*nonzero.*"
                         r"set_experts_implementation\(\"batched_mm\"\)"):
        torch.compile(logits_and_loss, backend="aot_eager", fullgraph=True)(scanned, ids())


def _aot_eager_recording():
    """aot_eager that keeps the forward graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []
    return graphs, aot_autograd(fw_compiler=lambda gm, _: graphs.append(gm) or gm.forward,
                                bw_compiler=lambda gm, _: gm.forward)


@pytest.mark.parametrize("family", SLOW_INDUCTOR)
def test_training_step_inductor(family, fresh_dynamo):
    ref, scanned = _twins(family, **COMPILED_SHAPE.get(family, {}))
    _assert_step_close(_step(scanned, torch.compile(logits_and_loss, fullgraph=True)), _step(ref))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate(family):
    ref, scanned = _twins(family)
    ref.eval(), scanned.eval()
    prompt, kw = ids(length=5, seed=3), dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = ref.generate(prompt, **kw)
    assert torch.equal(scanned.generate(prompt, **kw), want)  # the default cache: the layers one by one
    assert torch.equal(scanned.generate(prompt, use_cache=False, **kw), want)  # no cache: the scans
    if family not in ("recurrent_gemma", "qwen3_next"):  # their caches are not static ones
        assert torch.equal(scanned.generate(prompt, cache_implementation="static", **kw), want)


def test_generate_with_the_step_compiled(fresh_dynamo):
    ref, scanned = _twins("llama")
    ref.eval(), scanned.eval()
    prompt, kw = ids(length=5, seed=3), dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = ref.generate(prompt, use_cache=False, **kw)
    scanned.forward = torch.compile(scanned.forward, backend="aot_eager", dynamic=True)
    assert torch.equal(scanned.generate(prompt, use_cache=False, **kw), want)


def test_weights_round_trip(tmp_path):
    ref, scanned = _twins("gemma3")
    scanned.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path)
    loaded.config._attn_implementation = "eager"
    scan_model(loaded)
    _assert_step_close(_step(loaded), _step(ref))
    again = pickle.loads(pickle.dumps(scanned))
    _assert_step_close(_step(again), _step(ref))


def test_training_forward_keeps_a_cache_it_is_given():
    ref, scanned = _twins("llama")
    ref.eval(), scanned.eval()
    out_ref, out = ref(ids(), use_cache=True), scanned(ids(), use_cache=True)
    torch.testing.assert_close(out.logits, out_ref.logits, **TOL)
    assert out.past_key_values.get_seq_length() == out_ref.past_key_values.get_seq_length() == 7


def test_outside_the_forward_the_layers_are_the_layers():
    _, scanned = _twins("llama")
    layers = scanned.model.layers
    assert all(type(m).__name__ == "LlamaDecoderLayer" for m in layers)
    assert all(type(m).__name__ == "LlamaDecoderLayer" for m in layers[:2])


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h, scale=1.0):
        return torch.tanh(self.lin(h)) * scale


class _CollectsByHand(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, h):
        seen = []
        for layer in self.layers:
            seen.append(h)
            h = layer(h)
        return h, seen


class _ChangesBetweenLayers(_CollectsByHand):
    def forward(self, h):
        for layer in self.layers:
            h = layer(h) * 2
        return h


class _NoLoop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer()])

    def forward(self, h):
        return self.layers[0](h)


class _PlainLoop(_CollectsByHand):
    def forward(self, h):
        for i, layer in enumerate(self.layers):
            h = layer(h, scale=0.5 + i)
        return h


@pytest.mark.parametrize("model, message", [
    (_CollectsByHand(), r"_CollectsByHand.forward's loop over its layers \(line \d+\) does more than"),
    (_ChangesBetweenLayers(), r"does more than `hidden = layer\(hidden, ...\)`: 'h = layer\(h\) \* 2'"),
    (_NoLoop(), r"_NoLoop.forward has no loop over its layers"),
    ("not a model", r"expected a transformers model \(an nn.Module\), got str"),
])
def test_models_it_cannot_scan_are_refused(model, message):
    with pytest.raises(ScanError, match=message):
        scan_model(model)


def test_any_module_with_the_loop_scans(fresh_dynamo):
    model = _PlainLoop()
    h = torch.randn(2, 4)
    want = model(h)
    scan_model(model)
    torch.testing.assert_close(model(h), want)
    with pytest.raises(Exception, match="scale"):  # a plain value differing per layer cannot be a scan input
        torch.compile(model, backend="aot_eager", fullgraph=True)(h)


def _dynamo_recording():
    """Dynamo's graphs, run as they are (the scan node by its eager rule)."""
    graphs = []
    return graphs, lambda gm, _: graphs.append(gm) or gm.forward


# Qwen3-Next, kept to one traced graph (each takes ~12-15 s of Dynamo tracing on 2 cores): half the depth of its
# other tests, a full attention layer every 2nd (2 blocks of linear + full), the prefill (the chunked gated delta
# rule, ~20 s to trace) run eagerly, one decode step (a second one would trace a second graph: the dynamic layer's
# keys grow, and Dynamo recompiles with dynamic shapes)
DECODE_SHAPE = {"qwen3_next": dict(layers=4, full_every=2)}
EAGER_PREFILL = {"qwen3_next", "recurrent_gemma"}
NEW_TOKENS = {"qwen3_next": 2, "recurrent_gemma": 2}


@pytest.mark.parametrize("family, cache, prompt_length, recording", [
    ("gpt2", "static", 5, _aot_eager_recording),  # StaticLayer, the cache passed positionally
    ("mistral", "static", 2, _dynamo_recording),  # StaticSlidingWindowLayer, filling, then full
    ("gpt_oss", "dynamic", 3, _dynamo_recording),  # blocks of a DynamicSlidingWindowLayer and a DynamicLayer
    ("qwen3_next", "dynamic", 3, _dynamo_recording),  # blocks of a LinearAttentionLayer and a DynamicLayer
    # blocks of 2 recurrent layers (states on their modules: layers.module_state) and a sliding attention one
    ("recurrent_gemma", "dynamic", 3, _dynamo_recording),
])
def test_compiled_decode_step_is_one_scan(family, cache, prompt_length, recording, fresh_dynamo):
    """With the forward compiled, a decode step runs the stack as ONE scan whatever the depth, with
    transformers' static and dynamic caches, sliding-window and linear-attention layers included:
    each layer's cache slot is scanned as rows, updated out of place as the cache layer's own
    update does, and handed back to the cache after the scan. The tokens and every layer's cache
    after generate() are the unscanned model's. (The prefill, which fills the cache lazily, runs
    the layers one by one.)"""
    ref, scanned = _twins(family, **DECODE_SHAPE.get(family, {}))
    ref.eval(), scanned.eval()
    prompt = ids(length=prompt_length, seed=3)
    kw = dict(max_new_tokens=NEW_TOKENS.get(family, 4), do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ref.generate(prompt, **kw)
    runs = []  # per call of the compiled forward: the scan nodes its graphs ran
    compiled = _counted(torch.compile(scanned.forward, backend=_counting(recording()[1], runs)), runs)
    if family in EAGER_PREFILL:
        eager = scanned.forward
        scanned.forward = lambda *a, **k: (compiled if k["input_ids"].shape[-1] == 1 else eager)(*a, **k)
    else:
        scanned.forward = compiled
    got = scanned.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.past_key_values.layers, want.past_key_values.layers, strict=True):
        assert type(g) is type(w)
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(g, name, None), getattr(w, name, None))
        for name in ("conv_states", "recurrent_states"):  # linear attention: one state of each
            torch.testing.assert_close(getattr(g, name, None), getattr(w, name, None))
        for counter in ("cumulative_length", "cumulative_length_int", "has_previous_state"):
            assert getattr(g, counter, None) == getattr(w, counter, None), counter
    for g, w in zip(scanned.modules(), ref.modules(), strict=True):  # state kept on the modules (RecurrentGemma)
        for name in ("conv1d_state", "recurrent_states"):
            torch.testing.assert_close(getattr(g, name, None), getattr(w, name, None), rtol=0, atol=0)
    # counted per call, not per graph: transformers 5.17's RecurrentGemma forward breaks the graph before its
    # layers (it binds methods on the cache), its decode step three graphs, the stack in one of them as ONE scan
    if family in EAGER_PREFILL:  # decode steps only
        assert len(runs) >= 1 and set(runs) == {1}, runs
    else:  # the prefill (its layers one by one), then decode steps
        assert len(runs) >= 2 and runs[0] == 0 and set(runs[1:]) == {1}, runs


def _counting(backend, runs):
    """``backend`` whose compiled graphs, each time they run, add their scan nodes to ``runs[-1]``."""
    def compile_graph(gm, example_inputs):
        run, scans = backend(gm, example_inputs), sum(n.target is torch.ops.higher_order.scan for n in gm.graph.nodes)

        def counted(*args):
            runs[-1] += scans
            return run(*args)
        return counted
    return compile_graph


def _counted(compiled, runs):
    def call(*args, **kwargs):
        runs.append(0)
        return compiled(*args, **kwargs)
    return call
