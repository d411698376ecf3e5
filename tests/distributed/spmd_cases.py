"""XLA SPMD checks, run by tests/distributed/test_spmd.py in one child interpreter started on
4 virtual CPU devices in SPMD mode (``_isolated.call(..., env=_isolated.SPMD)``):
SPMD is process-wide, and a native crash must fail one test, not pytest.

Every check runs the program twice: scan on sharded XLA tensors, and the plain
Python loop on CPU tensors (unsharded), and compares values and gradients.
Shardings are on a Mesh(arange(4), (2, 2), ("fsdp", "tensor")).
"""
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from conftest import assert_trees_close, reference_scan
from xla_util import to_cpu, weighted_sum

from torch_scan_hop import ScanError, scan, scan_layers

DEV = torch_xla.device()
MESH = xs.Mesh(np.arange(4), (2, 2), ("fsdp", "tensor"))
assert xr.is_spmd() and xr.global_runtime_device_count() == 4


def spec(t):
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def on_xla(t, partition_spec=None):
    """A leaf XLA copy of the CPU tensor ``t``, sharded in place over MESH when asked."""
    t = t.detach().to(DEV)
    if partition_spec is not None:
        xs.mark_sharding(t, MESH, partition_spec)
    return t.requires_grad_(t.is_floating_point())


def annotate(t, partition_spec):
    """mark_sharding_with_gradients on XLA; the CPU loop runs the same body unannotated."""
    return xs.mark_sharding_with_gradients(t, MESH, partition_spec) if t.device.type == "xla" else t


def _run(make_body, weights, init, xseq, run_scan):
    """(outputs, grads w.r.t. weights, init, xs), on CPU."""
    body = make_body(*weights)
    out = run_scan(body, init, xseq)
    leaves = [*weights, init, xseq]
    grads = torch.autograd.grad(weighted_sum(out), leaves, allow_unused=True, materialize_grads=True)
    return out, grads


def check_scan(make_body, weights, init, xseq, *, specs=None, atol=1e-5, rtol=1e-5):
    """scan over XLA copies sharded by ``specs`` (weights..., init, xs) == the CPU loop.
    Returns the XLA leaves, grads and outputs for further checks."""
    specs = specs or [None] * (len(weights) + 2)
    leaves = [on_xla(t, s) for t, s in zip([*weights, init, xseq], specs)]
    got_out, got_grads = _run(make_body, leaves[:-2], leaves[-2], leaves[-1], scan)
    cpu = [t.clone().requires_grad_() for t in [*weights, init, xseq]]
    want = _run(make_body, cpu[:-2], cpu[-2], cpu[-1], reference_scan)
    assert_trees_close(to_cpu((got_out, got_grads)), want, atol=atol, rtol=rtol)
    for leaf, grad, s in zip(leaves, got_grads, specs):  # every sharded input's gradient is sharded alike
        if s is not None:
            assert spec(grad) == spec(leaf), (s, spec(grad), spec(leaf))
    return leaves, got_grads, got_out


def _sharded_weight_body(where, with_y):
    """tanh(c @ w + x) with the annotation at ``where``: the new carry (the issue's crash:
    with no y its gradient reaches the annotation straight from the body input), the
    incoming carry, the x slice, or nowhere (only the inputs are sharded)."""
    def make_body(w):
        def body(c, x):
            if where == "carry_in":
                c = annotate(c, ("fsdp", None))
            if where == "x":
                x = annotate(x, (None, "tensor"))
            h = torch.tanh(c @ w + x)
            if where == "carry_out":
                h = annotate(h, ("fsdp", None))
            return h, (h.sum(-1) if with_y else None)
        return body
    return make_body


def check_annotated_body(where, with_y):
    torch.manual_seed(0)
    w, init, xseq = torch.randn(8, 8) * 0.3, torch.randn(4, 8), torch.randn(5, 4, 8)
    check_scan(_sharded_weight_body(where, with_y), [w], init, xseq,
               specs=[("fsdp", "tensor"), ("fsdp", None), (None, "fsdp", None)])


def check_unsharded_inputs_sharded_in_body():
    """Nothing sharded outside, the body annotates; no grads needed for the carry."""
    torch.manual_seed(1)
    w, init, xseq = torch.randn(8, 8) * 0.3, torch.randn(4, 8), torch.randn(3, 4, 8)
    check_scan(_sharded_weight_body("carry_out", False), [w], init, xseq)


def check_annotated_bodies_are_captured_not_retraced():
    """An eager scan on XLA is captured by Dynamo and reused while its guards hold; a body
    calling mark_sharding_with_gradients used to fail that capture (torch_xla formats the
    mesh from a numpy array) and re-trace on every call. From the second call on (the first
    may meet a mesh made before the capture could read it) no call traces the body again,
    every call equals the loop, and a mesh of another layout is a new capture, not the old one."""
    import torch_scan_hop.api as api

    traced = []
    real = api._traced_body
    api._traced_body = lambda *a: traced.append(1) or real(*a)
    try:
        counts = []
        for seed in range(4):
            torch.manual_seed(10 + seed)
            w, init, xseq = torch.randn(8, 8) * 0.3, torch.randn(4, 8), torch.randn(5, 4, 8)
            check_scan(_sharded_weight_body("carry_out", True), [w], init, xseq,
                       specs=[("fsdp", "tensor"), ("fsdp", None), (None, "fsdp", None)])
            counts.append(len(traced))
        assert counts[1] == counts[2] == counts[3], counts  # calls 2-4: Dynamo's guards, no trace
        other = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "tensor"))

        def body(c, x):
            h = torch.tanh(c + x)
            return xs.mark_sharding_with_gradients(h, mesh, ("fsdp", None)), None

        for mesh, want in ((MESH, "devices=[2,1,2]"), (other, "devices=[4,1]")):
            c, _ = scan(body, on_xla(torch.randn(4, 8)), on_xla(torch.randn(3, 4, 8)))
            torch_xla.sync()
            assert spec(c).startswith("{" + want), (want, spec(c))
    finally:
        api._traced_body = real


def check_hlo_keeps_annotations():
    """The While's body computation carries the annotation (a Sharding custom call with sharding=)."""
    w = on_xla(torch.randn(8, 8), ("fsdp", "tensor"))
    c, _ = scan(_sharded_weight_body("carry_out", False)(w), on_xla(torch.randn(4, 8)), on_xla(torch.randn(3, 4, 8)))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([c])
    assert " while(" in hlo, hlo[-3000:]
    assert 'custom_call_target="Sharding"' in hlo and "sharding={devices=[2,1,2]" in hlo, hlo[-3000:]


def check_in_place_mark_sharding_is_a_scan_error():
    def body(c, x):
        h = torch.tanh(c + x)
        xs.mark_sharding(h, MESH, ("fsdp", None))
        return h, None
    try:
        scan(body, on_xla(torch.randn(4, 8)), on_xla(torch.randn(3, 4, 8)))
    except ScanError as e:
        assert "mark_sharding_with_gradients" in str(e), str(e)
    else:
        raise AssertionError("in-place mark_sharding in a scan body did not raise a ScanError")


class Block(torch.nn.Module):
    """A layer whose weights are sharded ("fsdp", "tensor") and whose output it annotates."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, h):
        h = h + self.b(torch.tanh(self.a(h)))
        return annotate(h, ("fsdp", None))


def _sharded_layers(n, d=16, dtype=torch.float32):
    torch.manual_seed(2)
    cpu = torch.nn.ModuleList([Block(d) for _ in range(n)]).to(dtype)
    model = torch.nn.ModuleList([Block(d) for _ in range(n)]).to(dtype)
    model.load_state_dict(cpu.state_dict())
    model = model.to(DEV)
    for layer in model:
        for lin in (layer.a, layer.b):
            xs.mark_sharding(lin.weight, MESH, ("fsdp", "tensor"))
    return cpu, model


def _check_sharded_stack_step(cpu, model, x, **options):
    """scan_layers(model, x sharded ("fsdp", None), **options), a weighted-sum backward: output,
    input and weight gradients as the loop's over ``cpu``, each 2-d weight's gradient sharded
    like the weight."""
    xd = on_xla(x, ("fsdp", None))
    out = scan_layers(model, xd, **options)
    weighted_sum(out).backward()
    want = cpu_x = x.clone().requires_grad_()
    for layer in cpu:
        want = layer(want)
    weighted_sum(want).backward()
    assert_trees_close(to_cpu((out, xd.grad)), (want, cpu_x.grad), atol=1e-5, rtol=1e-5)
    for (name, p), (_, q) in zip(model.named_parameters(), cpu.named_parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5)
        if p.dim() == 2:
            assert spec(p.grad) == spec(p), (name, spec(p.grad), spec(p))


def check_scan_layers_sharded_weights():
    cpu, model = _sharded_layers(4)
    _check_sharded_stack_step(cpu, model, torch.randn(8, 16))


def check_rebuilt_carry_in_sharded_layers():
    """A GELU layer stack with weights sharded ("fsdp", "tensor") and a sharded input, one While:
    each layer's saved input is rebuilt from the previous pre-activation (trace/shift.py) under
    SPMD too; values, gradients and the gradients' shardings as the loop's."""
    import torch_scan_hop.trace.shift as shift

    rebuilt, real = [], shift.rebuild_carries
    shift.rebuild_carries = lambda graph, shifts, *a: rebuilt.append(1) or real(graph, shifts, *a)
    try:
        torch.manual_seed(3)
        make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())  # noqa: E731
        cpu = torch.nn.ModuleList([make() for _ in range(4)])
        model = torch.nn.ModuleList([make() for _ in range(4)])
        model.load_state_dict(cpu.state_dict())
        model = model.to(DEV)
        for layer in model:
            xs.mark_sharding(layer[0].weight, MESH, ("fsdp", "tensor"))
        _check_sharded_stack_step(cpu, model, torch.randn(16, 64), unroll=1)
        assert rebuilt
    finally:
        shift.rebuild_carries = real


def check_cumsum_output_shardings():
    """Sharded init and xs (1D mesh): the outputs come out sharded like them."""
    mesh = xs.get_1d_mesh("model")
    init, xseq = torch.zeros(1024, device=DEV, requires_grad=True), torch.randn(8, 1024, device=DEV,
                                                                               requires_grad=True)
    xs.mark_sharding(init, mesh, ("model",))
    xs.mark_sharding(xseq, mesh, (None, "model"))
    carry, ys = scan(lambda c, x: (torch.sin(c + x),) * 2, init, xseq)
    torch_xla.sync()
    for t in (init, carry):
        assert "devices=[4]0," in spec(t), spec(t)
    for t in (xseq, ys):
        assert "devices=[1,4]0," in spec(t), spec(t)
    want = reference_scan(lambda c, x: (torch.sin(c + x),) * 2, init.detach().cpu(), xseq.detach().cpu())
    assert_trees_close(to_cpu((carry, ys)), want, atol=1e-5, rtol=1e-5)


class Stack(torch.nn.Module):
    """4 Linear(128, 128) layers, run by ``scan_layers`` (ours or torch_xla's) or as a loop."""

    def __init__(self, run=None):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        self.run = run

    def forward(self, x):
        return self.layers(x) if self.run is None else self.run(self.layers, x)


def _dots(model, x):
    import re

    hlo = torch_xla._XLAC._get_xla_tensors_hlo([model(x)])
    return re.findall(r"dot(?:\.\d+)? = f32\[([\d,]+)\]", hlo)


def check_xla_patched_linear_keeps_leading_dims():
    """torch_xla's einsum patch of nn.Linear survives the body trace: the While's dots keep
    the input's leading dims (3,4,5) that a sharding of them needs, instead of flattening to 60."""
    from torch_xla.distributed.spmd.xla_sharding import apply_xla_patch_to_nn_linear

    torch.manual_seed(42)
    model = Stack(scan_layers).to(DEV)
    x = torch.randn(3, 4, 5, 128, device=DEV)
    assert "60,128" in _dots(model, x), _dots(model, x)
    model = apply_xla_patch_to_nn_linear(model)
    dots = _dots(model, x)
    assert dots and all(d == "3,4,5,128" for d in dots), dots


def _bf16_outputs(x):
    """Our scan_layers, torch_xla's scan_layers and the Python loop, all in bfloat16 on XLA,
    and the loop on CPU, over the same (einsum-patched) weights."""
    from torch_xla.distributed.spmd.xla_sharding import apply_xla_patch_to_nn_linear
    from torch_xla.experimental.scan_layers import scan_layers as xla_scan_layers

    torch.manual_seed(42)
    cpu = Stack().bfloat16()
    outs = {}
    for name, run in (("ours", scan_layers), ("torch_xla", xla_scan_layers), ("xla_loop", None)):
        model = Stack(run).bfloat16()
        model.load_state_dict(cpu.state_dict())
        model = apply_xla_patch_to_nn_linear(model.to(DEV))
        outs[name] = model(x.to(DEV)).cpu()
    outs["cpu_loop"] = cpu(x)
    return outs


def check_bf16_numerics_match_torch_xla_scan():
    """The bf16 model against the CPU loop at torch_xla's test tolerance (1e-3), and, where
    the CPU's bf16 rounding differs from XLA's, against torch_xla's own scan_layers and the loop
    on XLA: ours gives their numbers."""
    x = torch.randn(3, 4, 5, 128).bfloat16()
    outs = _bf16_outputs(x)
    torch.testing.assert_close(outs["ours"], outs["torch_xla"], atol=0, rtol=0)
    torch.testing.assert_close(outs["ours"], outs["xla_loop"], atol=0, rtol=0)
    torch.testing.assert_close(outs["ours"], outs["cpu_loop"], atol=1e-2, rtol=1e-2)


def bf16_max_differences():
    """Max |difference| of ours from torch_xla's scan_layers, the XLA loop and the CPU loop."""
    outs = _bf16_outputs(torch.randn(3, 4, 5, 128).bfloat16())
    return {k: (outs["ours"].float() - v.float()).abs().max().item() for k, v in outs.items()}


def crash_for_test():
    """Dies of SIGSEGV, as a native crash would (test_spmd checks it fails one test only)."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)
