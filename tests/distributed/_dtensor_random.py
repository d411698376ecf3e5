"""Random DTensor scans against the Python loop over the same values as plain tensors, for
``_distributed_checks.dtensor_random_programs`` (run on every rank of the gloo group).

Each seed draws shapes (uneven over the ranks too), placements of the closed-over weight,
the init and xs (Replicate, Shard of any dim), a length of 1 or 3, reverse, remat, whether
the body has a y (a sum over the sharded dim: a Partial y where the carry is sharded there),
the form of the loss (gathered first, or reduced on the DTensors and gathered last) and
eager or aot_eager (static or dynamic shapes: refused with a sharded dim's size dynamic).
Values and the gradients of weight, init and xs must be the plain loop's (the loop over the
DTensors is no reference: torch 2.9's gets xs' gradient wrong for Replicate xs, and
DTensor's backward of a stack of Partial values fails). ``run_program_case`` draws richer
bodies (``_draw_program``); both compare by ``_against_the_loop``.

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


def run_case(seed, mesh, compile_fn):
    """Ours on DTensors against the loop on the plain tensors; raises on a difference.
    ``compile_fn(f, dynamic, backend)``: f compiled, with dynamic shapes or not. Returns the
    mode run, or "refused"."""
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
            if mode != "eager":
                fn = compile_fn(fn, dynamic=mode.endswith("dynamic"), backend="aot_eager")
            c, ys = fn(body, c0, xs)
        else:
            c, ys = _loop_tree(body, c0, xs, length, reverse)
        if gathered_first:
            loss = _full(c).square().sum() + (_full(ys).pow(2).sum() if with_y else 0)
        else:  # on DTensors: reduced first (a Partial y stays Partial), gathered last
            loss = _full(c.square().sum() + ((ys * 3).sum() if with_y else 0))
        loss.backward()
        out = [_full(loss).detach(), _full(c).detach(), *(_full(t.grad) for t in leaves)]
        return out + ([_full(ys).detach()] if with_y else [])

    case = f"seed {seed}: {batch}x{hidden}, length {length}, placements {place}, y {with_y}, {options}, {mode}"
    return _against_the_loop(run, case, mode, [v.shape for v in values], place)


def _against_the_loop(run, case, mode, shapes, place):
    """``run(ours)`` (the values and gradients, ours on DTensors or the loop on plain tensors)
    compared; with every size dynamic and a sharded one among them (a sharded dim's size not
    1), ours must be refused, alike on every rank. Returns ``mode``, or "refused"."""
    if mode == "aot_eager dynamic" and any(isinstance(p, Shard) and s[p.dim] != 1 for s, p in zip(shapes, place)):
        try:
            run(True)
        except ScanError as e:
            assert "sharded along" in str(e), f"{case}: {e}"
            return "refused"
        raise AssertionError(f"{case}: no ScanError for a dynamic size along a sharded dim")
    want = run(False)
    try:
        got = run(True)
    except Exception as e:
        raise AssertionError(f"{case}: {type(e).__name__}: {e}") from e
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-5, rtol=1e-5), (
            f"{case}: value/gradient {i}: {(g - w).abs().max() if g.shape == w.shape else (g.shape, w.shape)}")
    return mode


_ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin}


def _draw_program(rng):
    """The body's form: which optional inputs exist and what the body does with them."""
    return dict(
        carries=rng.choice([1, 2]), xs=rng.choice([1, 2]), bias=rng.random() < 0.4, v=rng.random() < 0.4,
        act=rng.choice(sorted(_ACTIVATIONS)), reuse_w=rng.random() < 0.4,
        y=rng.choice(["none", "sum", "pytree"]))


def _program_body(prog, w, v, b):
    """A body over (carry tuple, xs tuple) with closures ``w`` (used twice with ``reuse_w``),
    ``v`` and ``b``: the same code on DTensors and on plain tensors."""
    act = _ACTIVATIONS[prog["act"]]

    def body(c, x):
        h = c[0] @ w + x[0]
        if prog["xs"] == 2:
            h = h * torch.sigmoid(x[1])
        if b is not None:
            h = h + b
        h = act(h)
        if prog["reuse_w"]:
            h = torch.tanh(h @ w)
        if v is not None:
            h = h + 0.5 * (h @ v)
        new_c = (h,) if prog["carries"] == 1 else (h, c[1] * 0.9 + h.square() * 0.1)
        # a sum over the batch, not a mean: torch 2.9's DTensor mean over an unevenly sharded dim
        # averages the ranks' averages (Partial(avg)), its own loop alike; 2.11 on are right
        y = {"none": None, "sum": (2 * h).sum(-1), "pytree": {"scaled": h * 3, "batch": h.sum(0)}}[prog["y"]]
        return new_c, y
    return body


def _loop_tree(fn, c, xs, length, reverse):
    """The Python loop over pytrees: (final carry, ys stacked per leaf)."""
    from torch.utils._pytree import tree_map

    steps = range(length - 1, -1, -1) if reverse else range(length)
    ys = {}
    for i in steps:
        c, ys[i] = fn(c, tree_map(lambda t: t[i], xs))
    if ys[0] is None:
        return c, None
    return c, tree_map(lambda *rows: torch.stack(rows), *[ys[i] for i in range(length)])


def run_program_case(seed, mesh, compile_fn, inductor=False, mode=None):
    """A random body (``_draw_program``: pytree carries and xs, closures used more than once,
    a bias, pytree ys) over DTensors of random placements, against the loop on the plain
    tensors: the loss, final carry, ys and every leaf's gradient. ``compile_fn(f, dynamic, backend)``
    compiles f; ``inductor``: draw inductor as a mode too (its compile is seconds per case); ``mode``
    overrides the mode drawn. Returns the mode run, or "refused"."""
    from torch.utils._pytree import tree_leaves

    rng = random.Random(seed)
    prog = _draw_program(rng)
    batch, hidden, length = rng.choice([2, 3, 4]), rng.choice([2, 4, 5]), rng.choice([1, 2, 3])
    shapes = [(hidden, hidden), (hidden, hidden) if prog["v"] else None, (hidden,) if prog["bias"] else None,
              *[(batch, hidden)] * prog["carries"], *[(length, batch, hidden)] * prog["xs"]]
    shapes = [s for s in shapes if s is not None]
    place = [rng.choice([Replicate()] + [Shard(d) for d in range(len(s))]) for s in shapes]
    options = dict(reverse=rng.random() < 0.3, remat=rng.choice(["save_all", "min_cut", "recompute_all"]),
                   unroll=rng.choice([1, 1, 2]))
    drawn = rng.choice(["eager", "aot_eager", "aot_eager dynamic", "inductor"] if inductor else
                       ["eager", "aot_eager", "aot_eager dynamic"])
    mode = mode or drawn
    gathered_first = rng.random() < 0.5
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) * 0.5 for s in shapes]
    case = f"seed {seed}: {prog}, {batch}x{hidden}, length {length}, placements {place}, {options}, {mode}"
    print(case, flush=True)  # a rank that dies in a collective leaves its last case in the log

    def run(ours):
        _clear_sharding_cache()
        leaves = [(distribute_tensor(t, mesh, [p]) if ours else t.clone()).requires_grad_()
                  for t, p in zip(values, place)]
        it = iter(leaves)
        w, v, b = next(it), next(it) if prog["v"] else None, next(it) if prog["bias"] else None
        c0, xs = tuple(next(it) for _ in range(prog["carries"])), tuple(next(it) for _ in range(prog["xs"]))
        body = _program_body(prog, w, v, b)
        if ours:
            fn = lambda c, x: scan(body, c, x, **options)  # noqa: E731
            torch._dynamo.reset()  # as in run_case: each case compiles afresh on every rank
            if mode != "eager":
                fn = compile_fn(fn, dynamic=mode.endswith("dynamic"), backend=mode.split()[0])
            c, ys = fn(c0, xs)
        else:
            c, ys = _loop_tree(body, c0, xs, length, options["reverse"])
        outs = [*c, *(t for t in tree_leaves(ys) if t is not None)]
        if gathered_first:
            loss = sum(_full(t).square().sum() * (k + 1) for k, t in enumerate(outs))
        else:  # reduced on the DTensors (a Partial y stays Partial), gathered last
            loss = _full(sum((t * (k + 1)).sum() for k, t in enumerate(outs)))
        loss.backward()
        return [_full(loss).detach(), *(_full(t).detach() for t in outs), *(_full(t.grad) for t in leaves)]

    return _against_the_loop(run, case, mode, shapes, place)
