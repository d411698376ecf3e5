"""Random sharded scans on 4 virtual CPU devices (SPMD), against the plain loop on the CPU.

Run by tests/distributed/test_spmd.py in the SPMD child (``_isolated.SPMD``). Each seed draws a mesh
(2x2, 4, 1x4), shapes that the mesh does not divide (a batch of 5 rows over 2 devices),
lengths 0 to 5, reverse, ``remat`` and ``unroll``, in-place shardings of the inputs, and
``mark_sharding_with_gradients`` annotations at random points of a tanh RNN body (the
incoming carry, the x slice, the pre-activation, the new carry). Values and the gradients
of the weight, init and xs must be the loop's; nothing may crash the process. Random layer
stacks (``check_random_sharded_layer_stacks``): ``scan_layers`` over MLP layers whose weights are
sharded alike, against the loop on the CPU.
"""
import copy
import random

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from conftest import assert_trees_close, reference_scan
from xla_util import to_cpu, weighted_sum

from torch_scan_hop import scan

DEV = torch_xla.device()


def _meshes():
    return [xs.Mesh(np.arange(4), (2, 2), ("a", "b")), xs.Mesh(np.arange(4), (4,), ("a",)),
            xs.Mesh(np.arange(4), (1, 4), ("a", "b"))]


def _spec(rng, names, rank):
    """A partition spec of ``rank`` dims over the mesh's axis names (or None), each axis used once."""
    out, used = [], set()
    for _ in range(rank):
        name = rng.choice(names)
        out.append(None if name in used else name)
        used.add(name)
    return tuple(out)


def _body(w, mesh, annotations, with_y):
    """tanh(c @ w + x), annotated at the chosen points on XLA (the CPU loop runs it unannotated)."""
    def body(c, x):
        def ann(t, key):
            spec = annotations.get(key)
            return t if spec is None or t.device.type != "xla" else xs.mark_sharding_with_gradients(t, mesh, spec)
        c, x = ann(c, "carry_in"), ann(x, "x")
        h = torch.tanh(ann(c @ w + x, "pre"))
        h = ann(h, "carry_out")
        return h, ((2 * h).sum(-1) if with_y else None)
    return body


def check_random_sharded_scans(start, count):
    for seed in range(start, start + count):
        rng = random.Random(seed)
        mesh = rng.choice(_meshes())
        names = [*mesh.axis_names, None]
        batch, hidden, length = rng.choice([1, 3, 4, 5, 8]), rng.choice([2, 4, 6, 7]), rng.choice([0, 1, 2, 5])
        annotations = {k: _spec(rng, names, 2) for k in ("carry_in", "x", "pre", "carry_out") if rng.random() < 0.5}
        with_y, reverse = rng.random() < 0.6, rng.random() < 0.3
        options = dict(reverse=reverse, remat=rng.choice(["save_all", "min_cut", "recompute_all"]),
                       unroll=rng.choice([None, 1, 2, 3]))
        gen = torch.Generator().manual_seed(seed)
        cpu = [torch.randn(hidden, hidden, generator=gen) * 0.5, torch.randn(batch, hidden, generator=gen),
               torch.randn(length, batch, hidden, generator=gen)]
        leaves = []
        for t in cpu:
            leaf = t.to(DEV)
            if rng.random() < 0.7 and t.numel():  # torch_xla cannot shard an empty tensor
                xs.mark_sharding(leaf, mesh, _spec(rng, names, t.dim()))
            leaves.append(leaf.requires_grad_())
        case = f"seed {seed}: mesh {mesh.mesh_shape}, shapes {batch}x{hidden}, length {length}, {annotations}, {options}"
        try:
            got = scan(_body(leaves[0], mesh, annotations, with_y), leaves[1], leaves[2], **options)
            got_grads = torch.autograd.grad(weighted_sum(got), leaves, allow_unused=True, materialize_grads=True)
            cpu = [t.clone().requires_grad_() for t in cpu]
            want = reference_scan(_body(cpu[0], mesh, {}, with_y), cpu[1], cpu[2], reverse=reverse)
            want_grads = torch.autograd.grad(weighted_sum(want), cpu, allow_unused=True, materialize_grads=True)
            want_ys = want[1] if want[1] is not None or not with_y else torch.zeros(0, batch)  # the loop: no step
            assert_trees_close(to_cpu((got, got_grads)), ((want[0], want_ys), want_grads), atol=1e-4, rtol=1e-4)
        except Exception as e:
            raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e


def _layer_stack(rng, d, depth):
    """``depth`` identical-structure MLP layers (``_layers_random._Layer``: biases, activation,
    residual and pre-LayerNorm drawn once for the stack)."""
    from _layers_random import _ACTIVATIONS, _Layer

    kw = dict(ff=rng.choice([d, 2 * d]), bias=rng.random() < 0.7, act=rng.choice(sorted(_ACTIVATIONS)),
              residual=rng.random() < 0.7, norm=rng.random() < 0.4)
    return torch.nn.ModuleList(_Layer(d, **kw) for _ in range(depth)), kw


def check_random_sharded_layer_stacks(start, count):
    """Random MLP layer stacks (depth 1-4, widths the mesh may not divide) whose weights are
    sharded by ``mark_sharding`` with one random spec per parameter name (as a trainer shards
    every layer alike), an input sharded or not, remat and unroll drawn: ``scan_layers`` on
    XLA against the Python loop over the same layers on the CPU, the output and the gradients
    of every parameter and of the input."""
    from torch_scan_hop import scan_layers

    for seed in range(start, start + count):
        rng = random.Random(seed)
        mesh = rng.choice(_meshes())
        names = [*mesh.axis_names, None]
        d, depth, batch = rng.choice([4, 6, 8]), rng.choice([1, 2, 3, 4]), rng.choice([1, 3, 5, 8])
        torch.manual_seed(seed)
        cpu_layers, kw = _layer_stack(rng, d, depth)
        options = dict(remat=rng.choice(["save_all", "min_cut", "recompute_all"]), unroll=rng.choice([None, 1, 2]))
        x = torch.randn(batch, d, generator=torch.Generator().manual_seed(seed))
        layers = copy.deepcopy(cpu_layers).to(DEV)
        specs = {name: _spec(rng, names, p.dim()) for name, p in layers[0].named_parameters() if rng.random() < 0.7}
        for layer in layers:
            for name, p in layer.named_parameters():
                if name in specs:
                    xs.mark_sharding(p, mesh, specs[name])
        xd = x.to(DEV)
        if rng.random() < 0.5:
            xs.mark_sharding(xd, mesh, _spec(rng, names, 2))
        xd.requires_grad_()
        case = f"seed {seed}: mesh {mesh.mesh_shape}, d {d}, depth {depth}, batch {batch}, {kw}, {specs}, {options}"
        try:
            got = scan_layers(layers, xd, **options)
            got_grads = torch.autograd.grad(weighted_sum(got), [xd, *layers.parameters()])
            xc = x.clone().requires_grad_()
            want = xc
            for layer in cpu_layers:
                want = layer(want)
            want_grads = torch.autograd.grad(weighted_sum(want), [xc, *cpu_layers.parameters()])
            assert_trees_close(to_cpu((got, got_grads)), (want, want_grads), atol=1e-4, rtol=1e-4)
        except Exception as e:
            raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e
