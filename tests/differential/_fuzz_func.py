"""``vector_function``: a fuzz problem as a function of one vector, for the torch.func modes of
tests/differential/test_differential.py (split from _fuzz.py)."""
import contextlib
import random

import torch
import torch.utils._pytree as pytree

import _fuzz_writes
from _fuzz import FUZZ_DEVICE, tensors, tmap


def vector_function(p, inst, run, batched=None):
    """``(f, v, seen)``: the problem as a function of ONE vector, for torch.func's transforms.

    ``v`` holds every float input (init and xs leaves, closures, module parameters; with
    ``batched`` not None, as every func mode passes it, a seeded choice of them: a transform of
    some inputs only, e.g. of a closure with a plain init) flattened, plus one dummy element;
    the other inputs stay fixed. ``f(v)`` is every output of ``run(p, body, init, xs)`` (ints and bools cast to
    the float dtype) flattened into one vector, plus twice the dummy: neither is ever empty,
    also at length 0, where the ys hold no element. One input and one output because jacrev
    and jacfwd of several read a tensor's value while building their bases, which make_fx
    and Dynamo refuse. The scan sees slices of the transform's wrapped ``v``: views of
    wrapped tensors, as jvp's own primals are. ``seen`` collects the output pytree's
    structure, shapes and dtypes at every call, which the vector hides (ys of a wrong shape
    at length 0 hold no element either)."""
    params = list(inst.module.parameters()) if inst.module is not None else []
    names = [n for n, _ in inst.module.named_parameters()] if inst.module is not None else []
    leaves, spec = pytree.tree_flatten((inst.bases, inst.xs, inst.closures, params, inst.buffer_bases))
    fixed = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    chosen = [i for i, t in enumerate(fixed) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if batched is not None:
        rng = random.Random(p.seed + 3)
        chosen = [i for i in chosen if rng.random() < 0.6]
    v = torch.cat([fixed[i].reshape(-1) for i in chosen] + [torch.zeros(1, dtype=p.dtype, device=FUZZ_DEVICE)])
    seen = []

    def f(v):
        values, start = list(fixed), 0
        for i in chosen:
            values[i] = v[start:start + fixed[i].numel()].view(fixed[i].shape)
            start += fixed[i].numel()
        bases, xs, closures, params, buffer_bases = pytree.tree_unflatten(values, spec)
        init, buffers = _fuzz_writes.from_bases(p, bases), [b.clone() for b in buffer_bases]
        ctx, extra = contextlib.nullcontext(), []
        if inst.module is not None:  # around the scan: Dynamo refuses the context inside a body
            ctx = torch.nn.utils.stateless._reparametrize_module(inst.module, dict(zip(names, params)))
            extra = [inst.module]
        with ctx:
            out = run(p, inst.make_body(*closures, *buffers, *extra), init, xs, buffers)
        out = inst.observed(out, buffers)
        seen.append(str(tmap(lambda t: (tuple(t.shape), t.dtype), out)))
        return torch.cat([t.reshape(-1).to(p.dtype) for t in tensors(out)] + [v[-1:] * 2])
    return f, v, seen
