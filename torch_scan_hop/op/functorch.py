"""torch.func transforms of the op (vmap, grad, jvp).

The front end already composes: in eager, ``scan`` is the Python loop, and
every transform applies to its ops. These rules serve the op itself (graph
bodies from Dynamo or upstream's front end, and transforms under tracing):

* vmap: ONE scan over a batched body (``torch.vmap`` of the body), not a loop
  over the batch. The batch dim of xs sits right after the scan dim, so each
  slice is batched at 0; ys come back batched at dim 1. Which carries are
  batched is a fixed point over the body, as in jax's batching rule: a carry
  is batched if init is, or if the body makes it depend on something batched.
* grad / jvp: the loop itself at the transform's level (each step's ops are
  differentiated as they run), which also gives double backward, jacrev,
  jacfwd and hessian.
"""
import torch

from .. import _compat
from ..core.op_args import split_out
from ..trace.indexing import TensorIndexRewrite
from .hop import scan_op
from .loop import body_shape_run, carry_after_no_step, empty_ys, run_flat, shape_run


def _unwrap(t, level):
    """(value one level down, bdim or None) of an input at this vmap level."""
    if isinstance(t, torch.Tensor) and _compat.functorch_level(t) == level:
        return _compat.functorch_unwrap(t), _compat.functorch_bdim(t)
    return t, None


def _batched_outputs(combine_fn, args, in_dims, batch_size, num_carry):
    """Which outputs of one step are batched when the inputs are batched as
    ``in_dims`` says: a probe of the body on fake stand-ins (nothing computed).
    None if the body cannot be probed that way (then every carry is batched)."""
    found = []

    def probe(*a):
        outs = list(combine_fn(*a))
        found[:] = [_compat.is_batched_here(o) for o in outs]
        return [o.new_zeros(()) if isinstance(o, torch.Tensor) else o for o in outs][:1] or [torch.zeros(())]

    try:  # (a fake step index is read as in a trace: buf[t], buf.select(0, t))
        with _compat.fresh_fake_mode(), TensorIndexRewrite(refuse_lost_writes=False, refresh_stale_reads=False):
            fake = [_fake_input(a, d, batch_size) for a, d in zip(args, in_dims)]
            torch.vmap(probe, in_dims=tuple(in_dims), randomness="different")(*fake)
    except Exception:  # a body the probe cannot run (e.g. batched closures): batch every carry
        return None
    return found[:num_carry]


def _fake_input(a, bdim, batch_size):
    if not isinstance(a, torch.Tensor):
        return a
    shape = [batch_size, *a.shape] if bdim is not None else list(a.shape)
    return torch.zeros(shape, dtype=a.dtype, device=a.device)


def _carry_batching(combine_fn, init_batched, examples, other_dims, batch_size):
    """The carries' batched flags step by step, as the loop's become batched: ``[b0, b1, ..., bk]``,
    ``b0`` the init's, each the one a step with the one before gives, ``bk`` the fixed point (a step
    with it gives it again). Where a step cannot be probed (a body the probe cannot run, e.g. with
    batched closures, or one vmap refuses with those carries batched), every carry is batched from
    there: from step 0 if the init's cannot be probed. At most ``len(init_batched) + 2`` entries."""
    nc = len(init_batched)
    chain = [list(init_batched)]
    args = [*examples[0], *examples[1], *examples[2]]
    while len(chain) <= nc + 1:
        flags = chain[-1]
        in_dims = [0 if f else None for f in flags] + other_dims
        out = _batched_outputs(combine_fn, args, in_dims, batch_size, nc)
        if out is None:
            return [[True] * nc] if len(chain) == 1 else chain + [[True] * nc]
        grown = [f or o for f, o in zip(flags, out)]
        if grown == flags:
            return chain
        chain.append(grown)
    return chain


def _unbatched(combine_fn, inputs, examples):
    """Nothing is batched at this level: no input, and no output of a step (a closure the
    body reads, a random op under randomness="different" would batch one). Then the scan runs
    one level down as it is: a scan nested in a body that make_fx traces on unbatched stand-ins
    while the vmap is active came back batched (every y is batched below), outputs that trace
    did not track, which its graph returned as constants."""
    if any(d is not None for _, d in inputs):
        return False
    try:  # a probe at this level on fake stand-ins (nothing computed)
        with _compat.fresh_fake_mode():
            outs = list(combine_fn(*(_fake_input(a, None, 0) for group in examples for a in group)))
    except Exception:  # a body the probe cannot run: batched below, as before
        return False
    return not any(_compat.is_batched_here(o) for o in outs)


def _to_front(value, bdim, batched, batch_size):
    """A carry/lifted value with its batch dim at 0 (expanded if it must be batched)."""
    if bdim is not None:
        return value.movedim(bdim, 0)
    if batched:
        return value.unsqueeze(0).expand(batch_size, *value.shape).contiguous()
    return value


@scan_op.py_impl(_compat.TransformType.Vmap)
def scan_vmap(interpreter, combine_fn, init, xs, additional_inputs, **options):
    level, batch_size = interpreter.level(), interpreter.batch_size()
    init_u = [_unwrap(t, level) for t in init]
    xs_u = [_unwrap(t, level) for t in xs]
    lifted_u = [_unwrap(t, level) for t in additional_inputs]
    x_dims = [None if d is None else 0 for _, d in xs_u]
    lifted_dims = [None if d is None else 0 for _, d in lifted_u]
    with _compat.disable_proxy_modes_tracing():
        examples = ([_example(v, d) for v, d in init_u], [_example(v, d, scanned=True) for v, d in xs_u],
                    [_example(v, d) for v, d in lifted_u])
    if _unbatched(combine_fn, (*init_u, *xs_u, *lifted_u), examples):
        with interpreter.lower():
            return scan_op(combine_fn, init, xs, additional_inputs, **options)
    chain = _carry_batching(combine_fn, [d is not None for _, d in init_u], examples, x_dims + lifted_dims,
                            batch_size)
    # xs: the batch dim right after the scan dim, so every slice is batched at 0
    xs_b = [v if d is None else v.movedim(d, 1) for v, d in xs_u]
    lifted_b = [_to_front(v, d, False, batch_size) for v, d in lifted_u]
    length = next((v.shape[0] for v in xs_b if isinstance(v, torch.Tensor)), 0)
    # the loop's carries become batched step by step (a carry of a batched value from step 1 on): each
    # step before the fixed point runs alone, batched as the loop's (a write of such a carry into an
    # unbatched closed-over buffer at step 0 is refused by vmap where the loop's is not)
    first = min(len(chain) - 1, length)
    carry, dims, ys_first = [v for v, _ in init_u], [d for _, d in init_u], []
    for i in range(first):
        carry = [_to_front(v, d, False, batch_size) for v, d in zip(carry, dims)]
        dims, out_dims = [0 if b else None for b in chain[i]], [0 if b else None for b in chain[i + 1]]
        k = length - 1 - i if options.get("reverse") else i
        body = _batched_body(combine_fn, tuple(dims + x_dims + lifted_dims), out_dims, interpreter.randomness())
        with interpreter.lower():
            out = body(*carry, *(v.select(0, k) if isinstance(v, torch.Tensor) else v for v in xs_b), *lifted_b)
        carry, dims = out[:len(init)], out_dims
        ys_first.append([y.unsqueeze(0) for y in out[len(init):]])
    batched = chain[first] if first else chain[-1]  # (no step: the ys' shape run batched as ever)
    carry = [_to_front(v, d, b, batch_size) for v, d, b in zip(carry, dims, batched)]
    dims = [0 if b else None for b in batched]
    if first == 0 or first < length:
        rest = [_steps(v, first, length, options) for v in xs_b] if first else xs_b
        body = _batched_body(combine_fn, tuple(dims + x_dims + lifted_dims), dims, interpreter.randomness())
        try:
            with interpreter.lower():
                out = scan_op(body, carry, rest, tuple(lifted_b), **options)
        except RuntimeError as e:
            if not (_compat.is_vmap_inplace_error(e) and _no_step(xs_u)):
                raise
            return _no_step_outputs(interpreter, combine_fn, init_u, examples)
        carry, ys = split_out(out, len(init))
        ys_first.append(ys)
    if len(ys_first) > 1:  # in xs' order: a reverse scan's first steps are its last slices
        with interpreter.lower():
            ys = [torch.cat(list(parts[::-1] if options.get("reverse") else parts)) for parts in zip(*ys_first)]
    else:
        ys = ys_first[0]
    # ys are all batched (at 0 per step, so at 1 once stacked behind the scan dim)
    return [*(c if d is None else _compat.add_batch_dim(c, 0, level) for c, d in zip(carry, dims)),
            *(_compat.add_batch_dim(y, 1, level) for y in ys)]


def _steps(v, first, length, options):
    """The slices of ``v`` (scan dim first) of the steps from ``first`` on, in scan order."""
    if not isinstance(v, torch.Tensor):
        return v
    return v.narrow(0, 0, length - first) if options.get("reverse") else v.narrow(0, first, length - first)


def _no_step(xs_u):
    """The scan has no step (its xs are empty along the scan dim)."""
    return any(isinstance(v, torch.Tensor) and next(n for i, n in enumerate(v.shape) if i != d) == 0
               for v, d in xs_u)


def _no_step_outputs(interpreter, combine_fn, init_u, examples):
    """A scan with no step whose body vmap refuses to batch (an in-place op on an unbatched
    value by a batched one): the loop never calls it, so neither does this. The final carry
    is init (the op's copies, ``loop.carry_after_no_step``); the empty ys take the shapes of one
    unbatched step on fake stand-ins, as ``op.loop.empty_tree_ys`` does in eager."""
    with body_shape_run():  # (the step index read as in a trace, writes into closed-over tensors on stand-ins)
        ys = list(combine_fn(*(_fake_input(a, None, 0) for group in examples for a in group)))[len(init_u):]
    level = interpreter.level()
    with interpreter.lower():
        carry = carry_after_no_step([v for v, _ in init_u], op=True)
        empty = empty_ys(ys)
    return [*(c if d is None else _compat.add_batch_dim(c, d, level) for c, (_, d) in zip(carry, init_u)), *empty]


def _batched_body(combine_fn, in_dims, carry_dims, randomness):
    """``torch.vmap`` of the body: carries batched as ``carry_dims`` (their batching after the step),
    every y batched."""
    def body(*args):
        outs = list(combine_fn(*args))
        return outs[:len(carry_dims)], outs[len(carry_dims):]

    vmapped = torch.vmap(body, in_dims=in_dims, out_dims=(list(carry_dims), 0), randomness=randomness)

    def flat(*args):
        carry, ys = vmapped(*args)
        return [*carry, *ys]

    return flat


def _example(value, bdim, scanned=False):
    """A zero tensor of the logical (unbatched) shape; ``scanned``: of one slice
    (the scan dim is the logical dim 0)."""
    if not isinstance(value, torch.Tensor):
        return value
    drop = {bdim} if bdim is not None else set()
    if scanned:
        drop.add(next(i for i in range(value.dim()) if i not in drop))
    shape = [s for i, s in enumerate(value.shape) if i not in drop]
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _decomposed(interpreter, combine_fn, init, xs, additional_inputs, *, reverse=False, remat=None, unroll=1):
    """grad / jvp: the loop at this transform's level."""
    return run_flat(combine_fn, list(init), list(xs), tuple(additional_inputs), reverse)


scan_op.py_impl(_compat.TransformType.Grad)(_decomposed)
scan_op.py_impl(_compat.TransformType.Jvp)(_decomposed)
