"""Random DTensor scans against the Python loop over the same values as plain tensors, for
``_distributed_checks.dtensor_random_programs`` (run on every rank of the gloo group).

Each seed draws shapes (uneven over the ranks too), placements of the closed-over weight,
the init and xs (Replicate, Shard of any dim), a length of 1 or 3, reverse, remat, whether
the body has a y (a sum over the sharded dim: a Partial y where the carry is sharded there),
the form of the loss (gathered first, or reduced on the DTensors and gathered last) and
eager or aot_eager (static or dynamic shapes: refused with a sharded dim's size dynamic). Values and the gradients of weight, init and
xs must be the plain loop's (the loop over the DTensors is no reference: torch 2.9's gets
xs' gradient wrong for Replicate xs, and DTensor's backward of a stack of Partial values
fails).

DTensor's sharding-propagation cache is cleared before each run: in torch 2.9 a cached entry
from one run can fail the backward of the next (the DTensor loop run twice fails alone).
"""
import random

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from torch_scan_hop import ScanError, scan


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _clear_sharding_cache():
    """torch 2.9-2.15: ``propagate_op_sharding`` is a ``LocalLRUCache`` whose ``cache`` is an lru_cache."""
    prop = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    getattr(prop, "cache", prop).cache_clear()


def _loop(fn, c, xs, reverse):
    steps = range(xs.shape[0] - 1, -1, -1) if reverse else range(xs.shape[0])
    ys = {}
    for i in steps:
        c, ys[i] = fn(c, xs[i])
    return c, ys  # per step: DTensor's own backward of a stack of Partial values fails


def run_case(seed, mesh, compile_fn):
    """Ours on DTensors against the loop on the plain tensors; raises on a difference.
    ``compile_fn(f, dynamic)``: f compiled, with dynamic shapes or not."""
    rng = random.Random(seed)
    batch, hidden, length = rng.choice([2, 3, 4]), rng.choice([2, 4, 5]), rng.choice([1, 3])
    place = [rng.choice([Replicate()] + [Shard(d) for d in range(nd)]) for nd in (2, 2, 3)]
    reverse, with_y, gathered_first = rng.random() < 0.3, rng.random() < 0.7, rng.random() < 0.5
    options = dict(reverse=reverse, remat=rng.choice(["save_all", "min_cut", "recompute_all"]))
    mode = rng.choice(["eager", "aot_eager", "aot_eager dynamic"])
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(hidden, hidden, generator=gen) * 0.5, torch.randn(batch, hidden, generator=gen),
              torch.randn(length, batch, hidden, generator=gen)]

    def run(ours):
        """ours: scan over DTensors; else the loop over the plain tensors (the truth: DTensor's own
        loop gets some gradients wrong on torch 2.9, and fails others), the same loss either way."""
        _clear_sharding_cache()
        leaves = [(distribute_tensor(v, mesh, [p]) if ours else v.clone()).requires_grad_()
                  for v, p in zip(values, place)]
        w, c0, xs = leaves

        def body(c, x):
            h = torch.tanh(c @ w + x)
            return h, ((2 * h).sum(-1) if with_y else None)

        if ours:
            fn = lambda b, c, x: scan(b, c, x, **options)  # noqa: E731
            # each case compiles afresh on every rank: a graph reused across cases (one code object)
            # follows a rank's own local sizes, which uneven shards change on one rank only
            torch._dynamo.reset()
            c, ys = (fn if mode == "eager" else compile_fn(fn, dynamic=mode.endswith("dynamic")))(body, c0, xs)
        else:
            c, per_step = _loop(body, c0, xs, reverse)
            ys = torch.stack([per_step[i] for i in range(length)]) if with_y else None
        if gathered_first:
            loss = _full(c).square().sum() + (_full(ys).pow(2).sum() if with_y else 0)
        else:  # on DTensors: reduced first (a Partial y stays Partial), gathered last
            loss = _full(c.square().sum() + ((ys * 3).sum() if with_y else 0))
        loss.backward()
        out = [_full(loss).detach(), _full(c).detach(), *(_full(t.grad) for t in leaves)]
        return out + ([_full(ys).detach()] if with_y else [])

    if mode == "aot_eager dynamic" and any(isinstance(p, Shard) and v.shape[p.dim] != 1 for v, p in zip(values, place)):
        try:  # every size dynamic, a sharded one among them: refused, alike on every rank
            run(True)
        except ScanError as e:
            assert "sharded along" in str(e), str(e)
            return
        raise AssertionError(f"seed {seed}: no ScanError for a dynamic size along a sharded dim, {place}")
    want, got = run(False), run(True)
    case = f"seed {seed}: {batch}x{hidden}, length {length}, placements {place}, y {with_y}, {options}, {mode}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5, rtol=1e-5), (
            f"{case}: value/gradient {i}: {(g - w).abs().max() if g.shape == w.shape else (g.shape, w.shape)}")
