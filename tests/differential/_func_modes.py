"""The ``func_*`` modes of the differential fuzzer: torch.func's transforms of the scan (eager, under
make_fx and under torch.compile) against the same transform of the loop."""
import contextlib
import re

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from _fuzz import generate, materialize, run_loop
from _fuzz_check import Mismatch, check, traceable_kwargs
from _fuzz_func import vector_function
from torch_scan_hop import ScanError, scan

FUNC = {  # transform -> (f, v, r) -> its result, r: the weights, tangent and batch of v
    "grad": lambda f, v, r: torch.func.grad(lambda v: (f(v) * r[0]).sum())(v),
    "vjp": lambda f, v, r: (lambda out, pull: (out, pull(r[0])))(*torch.func.vjp(f, v)),
    "jvp": lambda f, v, r: torch.func.jvp(f, (v,), (r[1],)),
    "jacfwd": lambda f, v, r: torch.func.jacfwd(f)(v),
    "jacrev": lambda f, v, r: torch.func.jacrev(f)(v),
    "vmap": lambda f, v, r: torch.func.vmap(f)(r[2]),  # v's chosen leaves batched, the rest not
}
# documented, as run_compile asserts: no writes into closed-over tensors under torch.compile
COMPILE_REFUSES_CLOSURE_WRITES = re.compile(r"closed-over tensor.*under torch.compile")


def _compiled_loop_fails(ref, transform, v, r):
    """torch.compile of the same transform of the plain loop fails too (torch 2.9-2.15 cannot
    compile ``jvp`` through LayerNorm: an internal assert of ``_fw_primal`` in Dynamo's fake run)."""
    torch._dynamo.reset()
    try:
        torch.compile(lambda v, *r: FUNC[transform](ref, v, r), backend="aot_eager", fullgraph=True)(v, *r)
    except Exception:  # noqa: BLE001
        return True
    return False


def run_func(p, mode, want_out, want_grads, weights):
    """A torch.func transform of the scan (as a function of one vector, ``vector_function``)
    against the same transform of the loop (vmap: the loop per sample), at lengths 0 and 1 and,
    in eager, the problem's own; ``func_<t>_make_fx`` and ``func_<t>_compile`` (aot_eager)
    trace the transformed function, the latter at length 0 or 1 (by seed and transform)."""
    transform, traced = mode.split("_")[1], "_".join(mode.split("_")[2:])
    with _sdpa_for(transform):
        return _run_func(p, mode, transform, traced)


def _sdpa_for(transform):
    """torch has no forward AD for CPU flash attention: jvp and jacfwd take the math kernel."""
    if transform not in ("jvp", "jacfwd"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _draws(q, ref, v):
    """The weights of ``ref``'s outputs, a tangent and a batch of ``v``."""
    g = torch.Generator().manual_seed(q.seed + 2)
    size = ref(v).numel()
    return (torch.randn(size, generator=g, dtype=torch.float64).to(v.device, q.dtype),
            torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device, q.dtype),
            torch.stack([v, v * 0.5 + 0.25]))


def trace_loop(mode, seed):
    """make_fx of ``mode``'s transform of the loop (not of the scan), at the lengths a ``func_<t>_make_fx``
    case traces: where this crashes the interpreter, there is no reference for the scan's trace
    (``test_differential.check_func_make_fx``)."""
    transform = mode.split("_")[1]
    torch.manual_seed(0)
    p = generate(seed)
    with _sdpa_for(transform):
        for q in (p.with_length(n) for n in (0, 1)):
            ref, v, _ = vector_function(q, materialize(q), run_loop, batched=transform == "vmap")
            r = _draws(q, ref, v)
            make_fx(lambda v, *r: FUNC[transform](ref, v, r))(v, *r)


def _run_func(p, mode, transform, traced):
    lengths = [0, 1] + ([p.length] if p.length > 1 and not traced else [])
    if traced == "compile":
        lengths = [(p.seed + list(FUNC).index(transform)) % 2]
    for q in (p.with_length(n) for n in lengths):
        inst = materialize(q)
        kw = traceable_kwargs(q, inst, lambda f: torch.compile(f, backend="eager", fullgraph=True)) \
            if traced == "compile" else q.kwargs()
        ours, v, seen = vector_function(q, inst, lambda q, body, init, xs, _: scan(body, init, xs, **kw),
                                        batched=transform == "vmap")
        ref, _, ref_seen = vector_function(q, materialize(q), run_loop, batched=transform == "vmap")
        r = _draws(q, ref, v)
        want = torch.stack([ref(b) for b in r[2]]) if transform == "vmap" else FUNC[transform](ref, v, r)
        apply = lambda v, *r: FUNC[transform](ours, v, r)  # noqa: E731
        # vmap cannot run the loop (an in-place op on an unbatched value): ours may say the same, or,
        # tracing the body once and batching the functional graph, give the per-sample loop's values.
        # At length 0 the loop never calls fn (the reference calls it once for the ys' shapes).
        refused = vmap_refusal(ref, r[2]) if transform == "vmap" else None
        try:
            if traced == "make_fx":
                apply = make_fx(apply)(v, *r)
            elif traced == "compile":
                torch._dynamo.reset()
                apply = torch.compile(apply, backend="aot_eager", fullgraph=True)
            got = apply(v, *r)
        except Exception as e:  # noqa: BLE001
            if refused is not None and refused in str(e):
                continue
            if refused is not None and q.writes is not None and str(e).startswith("vmap:") and "not possible" in str(e):
                continue  # the same in-place refusal of another op (traced: index_put_, the loop's copy_)
            if traced == "make_fx" and q.writes is not None and isinstance(e, ScanError) \
                    and "tracing_mode='fake'" in str(e):
                continue  # documented (as run_make_fx's): make_fx's real mode traces the op's body on
                # uninitialized stand-ins, where an index read from a tensor (buf[t]) is out of range
            if traced == "compile" and inst.buffers and isinstance(e, ScanError) \
                    and COMPILE_REFUSES_CLOSURE_WRITES.search(str(e)):
                continue
            if traced == "compile" and _compiled_loop_fails(ref, transform, v, r):
                continue  # torch cannot compile this transform of the loop either: no reference here
            raise
        if traced == "compile" and inst.buffers:
            raise Mismatch(f"{transform} compile at length {q.length}: the body writes into closed-over "
                           "tensors, which torch.compile refuses with a ScanError, but the call ran")
        what = f"{transform}{' ' + traced if traced else ''} at length {q.length}"
        check(q, "eager" if not traced else mode, what, got, want)
        if traced != "compile" and set(seen) != {ref_seen[0]}:
            raise Mismatch(f"{what}: the outputs' structure, shapes and dtypes {sorted(set(seen))} "
                           f"differ from the loop's {ref_seen[0]}")


def vmap_refusal(ref, batch):
    """The first line of vmap's error for the loop over ``batch``, else None: vmap refuses a
    body that multiplies an unbatched clone in place by a batched value (``a.clone().mul_(b)``)
    in the loop too, which the per-sample reference cannot tell; written into an unbatched 0-d
    carry (``a.mul_(0.5).add_(b.mean())``) that refusal is the in-place op's own shape error
    ("output with shape [] doesn't match the broadcast shape [2]"). Ours must raise the same."""
    try:
        torch.func.vmap(ref)(batch)
    except RuntimeError as e:
        if str(e).startswith("vmap:") or "doesn't match the broadcast shape" in str(e):
            return str(e).splitlines()[0][:80]
        raise
    return None
