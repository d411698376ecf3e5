"""Hugging Face layers through ``scan_layers`` under XLA SPMD (4 virtual CPU devices), against the
model's own loop on the CPU: the output and the gradients of every parameter and input.

Run by tests/distributed/test_spmd.py in the SPMD child (``_isolated.SPMD``). The layers' weights are sharded
as trainers shard them: FSDP-style (dim 0 over the "fsdp" axis) or Megatron-style on a
("fsdp", "tensor") mesh (q/k/v and gate/up column-parallel, o and down row-parallel); the model
and its keyword inputs come from ``test_hf_layers.build``.
"""
import copy

import numpy as np
import test_hf_layers as hf
import torch.utils._pytree as pytree
import torch_xla
import torch_xla.distributed.spmd as xs
from conftest import assert_trees_close

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj", "out_proj")


def _spec(name, p, style):
    if style == "fsdp":
        return ("fsdp",) + (None,) * (p.dim() - 1)
    column, row = any(k in name for k in _COLUMN), any(k in name for k in _ROW)
    if column:
        return ("tensor", "fsdp")[:p.dim()]
    if row and p.dim() == 2:
        return ("fsdp", "tensor")
    return (None,) * p.dim()


def check_hf_layers_sharded(name, style, mesh_shape, unroll):
    """``style``: "fsdp" or "megatron"; ``mesh_shape``: (4,) or (2, 2); ``unroll``: 2
    (straight-line, 2 layers) or 1 (one While, the default)."""
    dev = torch_xla.device()
    mesh = xs.Mesh(np.arange(4), mesh_shape, ("fsdp", "tensor")[:len(mesh_shape)])
    stack, inputs, _ = hf.build(name)
    want = hf.value_and_grads(stack, stack.loop, hf.fresh(inputs))
    stack = copy.deepcopy(stack).to(dev)
    for layer in stack.layers:
        for pname, p in layer.named_parameters():
            spec = _spec(pname, p, style)
            if any(spec):
                xs.mark_sharding(p, mesh, spec)
    inputs = pytree.tree_map(lambda t: t.detach().to(dev).requires_grad_(t.requires_grad), inputs)
    run = lambda h, tensors: hf.scan_layers(stack.layers, h, unroll=unroll, **tensors, **stack.static)
    got = hf.value_and_grads(stack, run, inputs)
    torch_xla.sync()
    assert_trees_close(pytree.tree_map(lambda t: t if t is None else t.detach().cpu(), got), want, **hf.TOL)


def check_scan_model_sharded(family, style, mesh_shape):
    """A whole model through ``scan_model`` (one While: ``unroll=1``) with every decoder layer's
    weights sharded (``style`` as above), against its unscanned twin on the CPU: logits and every
    parameter's gradient."""
    import torch
    from hf_families import build, ids, logits_and_loss
    from test_scan_model_xla import step_on_cpu

    from torch_scan_hop import scan_model

    torch.manual_seed(0)
    ref = build(family)
    model = scan_model(copy.deepcopy(ref), unroll=1).to(torch_xla.device())
    mesh = xs.Mesh(np.arange(4), mesh_shape, ("fsdp", "tensor")[:len(mesh_shape)])
    for layer in model.model.layers:
        for pname, p in layer.named_parameters():
            spec = _spec(pname, p, style)
            if any(spec):
                xs.mark_sharding(p, mesh, spec)
    want = step_on_cpu(ref, logits_and_loss, ids())
    got = step_on_cpu(model, logits_and_loss, ids().to(torch_xla.device()), expect_while=True)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-4)
