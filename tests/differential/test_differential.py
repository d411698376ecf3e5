"""Differential fuzzing: random scan problems (tests/differential/_fuzz.py) against the Python loop in every mode.

Each case is one (mode, seed) and the problem is a pure function of the seed:
``pytest tests/differential/test_differential.py -k "eager-seed_17]"`` replays one case, ``-k "seed_17]"``
the seed in every mode; a failure prints the generated body and shapes. Values and
gradients (of a weighted sum of the float outputs w.r.t. float inputs, closures and module
parameters) are compared; export is inference only. XLA cases run in a child interpreter
(_isolated.py): a native crash fails the case, not the run.

The ``func_*`` modes apply torch.func's grad, vjp, jvp, jacfwd, jacrev and vmap to the scan (in
eager, under make_fx and under torch.compile) and compare with the same transform of the loop, at
lengths 0 and 1 above all; the make_fx ones run in a child interpreter too (check_func_make_fx).

About a quarter of the seeds write in place (_fuzz_writes.py: carry leaves, carried and closed-over
buffers written at the step index); the closed-over buffers' contents after the scan are compared
too, and where such writes are documented as a ScanError (torch.compile, strict export) the case
asserts it. Under inductor, where the scan differs from the eager loop, the reference is the same loop
compiled by inductor (its kernels may round differently where the math is not smooth, e.g. at ties
of ``amax``). No case is expected to fail.

Budget: the default run takes about 3 minutes on 2 cores (the func modes about 30 s of it).
SCAN_FUZZ_CASES=N runs N eager cases and scales every other mode by the same factor;
SCAN_FUZZ_SEED=S starts the seeds at S.
"""
import contextlib
import io
import os
import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

import _fuzz_writes
import _isolated
from _fuzz import generate, grads, loop, loss_weights, materialize, run_loop, tensors, tmap
from _fuzz_check import Mismatch, check, traceable_kwargs
from _func_modes import run_func
from torch_scan_hop import ScanError, scan

DEFAULT_CASES = {  # mode -> cases in the default run (eager is the scale)
    "eager": 60, "make_fx_real": 12, "make_fx_fake": 12, "make_fx_symbolic": 12,
    "compile_eager": 4, "compile_aot_eager": 3, "compile_aot_eager_dynamic": 2,
    "compile_inductor": 2, "compile_inductor_dynamic": 1,
    "export_strict": 3, "export_nonstrict": 3, "export_saveload": 2, "xla": 4,
    # torch.func transforms (run_func): eager and make_fx cases at lengths 0 and 1 (eager also at
    # the problem's own), compile cases at one of them (~2 s a compile)
    **{f"func_{t}{trace}": n for trace, n in [("", 2), ("_make_fx", 1), ("_compile", 1)]
       for t in ["grad", "vjp", "jvp", "jacfwd", "jacrev", "vmap"]},
}
_SCALE = int(os.environ.get("SCAN_FUZZ_CASES", DEFAULT_CASES["eager"])) / DEFAULT_CASES["eager"]
_START = int(os.environ.get("SCAN_FUZZ_SEED", 0))
CASES = [pytest.param(mode, seed, id=f"{mode}-seed_{seed}")
         for mode, n in DEFAULT_CASES.items()
         for seed in range(_START, _START + max(1, round(n * _SCALE)))]


def expected(p):
    inst = materialize(p)
    out = loop(p, inst)
    weights = loss_weights(p, out)
    return out, grads(inst.targets(), out, weights), weights


def flags(out):
    return [t.requires_grad for t in tensors(out)]


@pytest.mark.parametrize("mode,seed", CASES)
def test_fuzz(mode, seed):
    if mode == "xla":  # in a child interpreter: a native crash fails this case, not the whole run
        pytest.importorskip("torch_xla", reason="torch_xla is not installed")
        return _isolated.call("test_differential", "check_case", mode, seed)
    if mode.startswith("func_") and mode.endswith("_make_fx"):
        return check_func_make_fx(mode, seed)
    check_case(mode, seed)


def check_func_make_fx(mode, seed):
    """A ``func_<t>_make_fx`` case in a child interpreter. torch 2.9 and 2.15 segfault in make_fx of
    forward AD of ``a.add_(b, alpha=0.3)``, ``a`` with a tangent and ``b`` without (seed 23002: the
    loop's body, which the scan runs as the loop does at length 1): where make_fx of the same
    transform of the loop crashes too, there is no reference, as under torch.compile
    (``_func_modes._compiled_loop_fails``)."""
    try:
        _isolated.call("test_differential", "check_case", mode, seed)
    except AssertionError as e:
        if "crashed the interpreter" not in str(e):
            raise
        try:
            _isolated.call("_func_modes", "trace_loop", mode, seed)
        except AssertionError as loop_error:
            if "crashed the interpreter" in str(loop_error):
                return
        raise


# fuzz cases that found a bug, replayed in every run whatever SCAN_FUZZ_CASES says (mode, seed)
REGRESSIONS = [
    ("func_grad_compile", 2),  # length 0 under AOTAutograd: the ys' fake run met its fake mode
    ("func_jvp", 5010),  # length 0: LayerNorm's jvp formula (a constant bias) in the ys' fake run
    ("func_vmap_compile", 7001),  # vmap refuses the body's mul_; torch 2.15's error kept its text
    ("func_grad", 11000),  # grad of the closures alone with a partition function: the op's trace met the wrappers
    ("func_vmap", 12005),  # length 0: an unbatched stand-in for a batched carry, then a mul_ by a batched value
    ("func_vmap_make_fx", 13002),  # a non-dense (batched) init met the traced body's view at step 0
    # length 0: vmap refuses the body (a batched x slice into an unbatched one in place), which the
    # loop never runs there: eager, make_fx and compile must still give the empty ys
    ("func_vmap", 30001), ("func_vmap_make_fx", 30001), ("func_vmap_compile", 30001),
    # XLA, unroll=3 over 7 steps: the last step's saved amax was 1 ulp off its saved input's maximum
    # (two fusions of one expression), so amax's gradient found no maximum: now recomputed backward
    ("xla", 300028),
    # XLA: a body whose carry and ys are all None ("No XlaOp with handle 0" building an empty While)
    ("xla", 400009), ("xla", 400085),
    # inductor, dynamic length, dim=2, min_cut: torch 2.9-2.11 misread symbolically strided xs rows in
    # the backward loop (every gradient through the carry wrong): such xs are copied contiguous first
    ("compile_inductor_dynamic", 910003),
    # in-place writes (_fuzz_writes.py, issue 63 item 5):
    ("eager", 25),  # length 0, with_index: the ys' shape run read its fake step index (buf[t] = ...)
    ("func_vmap", 7),  # the same in the op's flat shape run (under vmap)
    ("func_grad", 74),  # length 0: the shape run wrote fake values into a closed-over buffer (grad's wrapper)
    ("make_fx_fake", 24),  # the trace finding a closure write wrote the closure's autograd history: fake constants
    # a partition function: closure writes after a retrace on copies of written carries were refused,
    # then (that fixed) the trace's history on the closure gave FakeTensor gradients
    ("eager", 70),
    ("make_fx_real", 32),  # an uninitialized index out of range in index_select: IndexError, not the ScanError
    ("make_fx_fake", 131),  # c.copy_(v) in the body, the graph differentiated: no derivative for aten::copy
    # length 0 under vmap, the ys' shape run on batched stand-ins: buf[t] = row (index_put_'s refusal) and
    # a.mul_(0.5).add_(b) into an unbatched 0-d carry (a shape error) were not retried unbatched
    ("func_vmap", 93), ("func_vmap", 37),
    # a partition function (the op's vmap rule): a carry batched from step 0 where the loop's becomes batched at
    # step 1, written into an unbatched closed-over buffer, was refused at step 0 (and the batching probe read
    # the fake step index: every carry batched)
    ("func_vmap", 148),
    # inductor's own bits break a tie of amax's input that eager has (a LayerNorm of an arithmetic row):
    # the scan and the loop compiled by inductor agree, both differ from eager (the reference there)
    ("compile_inductor", 7022),
    # odd seeds differentiate the graph: its targets were read after it ran, when its (correct) writes of values
    # requiring grad into closed-over buffers that did not had made those buffers targets too (9 != 7 gradients)
    ("make_fx_fake", 8005), ("make_fx_fake", 8039),
    ("make_fx_real", 8057),  # a None carry leaf before a written one: _fuzz_writes.prepare cloned the None
    # closed-over buffers written at the step index, remat="sqrt" (nested scans) under make_fx's fake mode: the
    # outer body's stand-in mode stood in again for the nested body's stand-in, so the nested scan carried a
    # tensor the body never names and found the writes again on every retrace (a RecursionError, then a ScanError)
    ("make_fx_fake", 8058),
    # symbolic, remat="default_partition", with_index: the backward's symbolic sizes were computed by running the
    # forward step under the trace on uninitialized stand-ins; torch 2.9 keeps an attention (a seeded op) and all
    # before it, so the graph read a buffer at an uninitialized step index (an IndexError, by what memory held)
    ("make_fx_symbolic", 8095),
    # compiled vmap of a body writing into a batched closed-over tensor: Dynamo's check missed the write (the
    # batched value's version only), so the ScanError came under AOTAutograd's vmap levels, where torch 2.9's
    # cleanup of them masked it with an internal assert ("!dynamicLayerStack.empty()")
    ("func_vmap_compile", 20000),
    # make_fx of jvp / jacfwd segfaults in torch (the loop's too): the harness now runs these cases in a child
    ("func_jvp_make_fx", 23002),
    ("eager", 24045),  # _fuzz_writes drew carry.mul_(torch.sigmoid(0.25)): a TypeError in the loop itself
    # XLA, remat="sqrt": a saved carry input the While writes from the step before's output lacked that step's
    # pending row (a closed-over buffer written at t, read at t - 1): the recomputed step read the old row
    ("xla", 24004),
    # remat="recompute_all", a carry leaf that c.mul_(w) made require grad at step 1: its kept carry, computed again
    # once the write was seen, took the flags after the write; the re-run saved one tensor more (a ScanError)
    ("eager", 25092),
]


@pytest.mark.parametrize("mode,seed", [pytest.param(m, s, id=f"{m}-seed_{s}") for m, s in REGRESSIONS])
def test_fuzz_regression(mode, seed):
    if mode.startswith("func_") and mode.endswith("_make_fx"):
        return check_func_make_fx(mode, seed)
    check_case(mode, seed)


def check_case(mode, seed):
    torch.manual_seed(0)
    p = generate(seed)
    want_out, want_grads, weights = expected(p)
    try:
        RUNNERS[mode.split("_")[0]](p, mode, want_out, want_grads, weights)
    except Exception as e:  # noqa: BLE001  (any failure: print the problem)
        cause = None if isinstance(e, Mismatch) else e  # an error in the package: keep its traceback
        raise AssertionError(f"[{mode}] {type(e).__name__}: {e}\n\n{p.describe()}") from cause


def run_eager(p, mode, want_out, want_grads, weights):
    with torch.no_grad():
        inst = materialize(p)
        check(p, mode, "values under no_grad", inst.observed(scan(inst.body, inst.init, inst.xs, **p.kwargs())),
              want_out)
    inst = materialize(p)
    out = inst.observed(scan(inst.body, inst.init, inst.xs, **p.kwargs()))
    check(p, mode, "values", out, want_out)
    if p.length > 0 and flags(out) != flags(want_out):
        raise Mismatch(f"requires_grad of the outputs {flags(out)} != the loop's {flags(want_out)}")
    check(p, mode, "gradients", grads(inst.targets(), out, weights), want_grads)
    # a second call (cache hit) with a fresh body: other inputs, same closures
    p2 = p.with_length(p.length + 2)
    inst2 = materialize(p2)
    want2 = loop(p2, materialize(p2))
    body2 = inst2.make_body(*inst.closures, *inst2.buffers, *([inst.module] if inst.module is not None else []))
    check(p, mode, f"values of a second call at length {p2.length}",
          inst2.observed(scan(body2, inst2.init, inst2.xs, **p2.kwargs())), want2)


def run_make_fx(p, mode, want_out, want_grads, weights):
    tracing_mode = mode.split("_")[-1]
    backward_inside = p.seed % 2 == 0  # even seeds trace autograd.grad too, odd ones differentiate the graph
    inst = materialize(p)
    names = [n for n, _ in inst.module.named_parameters()] if inst.module is not None else []

    def f(init, xs, closures, params, weights, buffers):  # init: Instance.bases
        ctx = (torch.nn.utils.stateless._reparametrize_module(inst.module, dict(zip(names, params)))
               if inst.module is not None else contextlib.nullcontext())
        with ctx:  # buffers not requiring grad are written as they are: inputs of the graph written
            targets = [t for t in tensors((init, xs, closures, params, buffers)) if t.requires_grad]  # before writes
            bufs = [b.clone() if b.requires_grad else b for b in buffers]
            body = inst.make_body(*closures, *bufs, *([inst.module] if inst.module is not None else []))
            out = inst.observed(scan(body, _fuzz_writes.from_bases(p, init), xs, **p.kwargs()), bufs)
            return out, (grads(targets, out, weights) if backward_inside else [])

    def args(i):
        params = list(i.module.parameters()) if i.module is not None else []
        return i.bases, i.xs, i.closures, params, weights, i.buffer_bases

    # an explicit table keeps detach a detach on torch 2.14 (its default records it as alias), so that
    # differentiating the graph below (odd seeds) can match the loop
    try:
        gm = make_fx(f, tracing_mode=tracing_mode, decomposition_table={})(*args(inst))
    except ScanError as e:  # documented: real mode traces on uninitialized stand-ins, a step index out of range
        if tracing_mode == "real" and p.writes is not None and "tracing_mode='fake'" in str(e):
            return
        raise
    fresh = materialize(p)
    targets = fresh.targets()  # before the graph runs: it writes closed-over buffers, maybe with grad values
    out, got_grads = gm(*args(fresh))
    check(p, mode, "values of the traced graph", out, want_out)
    if not backward_inside:  # the graph's scan node differentiated by the op's autograd rule
        got_grads = grads(targets, out, weights)
    check(p, mode, f"gradients ({'traced' if backward_inside else 'through the graph'})", got_grads, want_grads)


def run_compile(p, mode, want_out, want_grads, weights):
    backend = "aot_eager" if "aot_eager" in mode else mode.split("_")[1]
    torch._dynamo.reset()
    inst = materialize(p)
    kw = traceable_kwargs(p, inst, lambda f: torch.compile(f, backend=backend, fullgraph=True))

    def f(init, xs, n):  # a length= option is an argument, so that it can be dynamic
        return scan(inst.body, init, xs, **dict(kw, length=n) if "length" in kw else kw)

    cf = torch.compile(f, backend=backend, dynamic="dynamic" in mode, fullgraph=True)
    if inst.buffers:  # documented: no writes into closed-over tensors under torch.compile
        with pytest.raises(ScanError, match=r"closed-over tensor.*under torch.compile"):
            cf(inst.init, inst.xs, p.length)
        return
    out = cf(inst.init, inst.xs, p.length)
    got_grads = grads(inst.targets(), out, weights)
    try:
        check(p, mode, "values", out, want_out)
        check(p, mode, "gradients", got_grads, want_grads)
    except Mismatch:
        if backend != "inductor":
            raise
        _check_against_compiled_loop(p, mode, backend, out, got_grads, weights)
    if "dynamic" in mode:  # the same compiled function at another length (same closures and module)
        p2 = p.with_length(p.length + 3)
        ref2, inst2 = materialize(p2), materialize(p2)
        want2 = loop(p2, ref2)
        w2 = loss_weights(p2, want2)
        out2 = cf(inst2.init, inst2.xs, p2.length)
        check(p, mode, f"values at length {p2.length}", out2, want2)
        targets2 = [t for t in tensors((inst2.bases, inst2.xs)) if t.requires_grad] + inst.targets(inputs=False)
        check(p, mode, f"gradients at length {p2.length}", grads(targets2, out2, w2), grads(ref2.targets(), want2, w2))


def _check_against_compiled_loop(p, mode, backend, out, got_grads, weights):
    """Where inductor's scan differs from the eager loop, the reference is inductor's own loop: the
    same Python loop compiled by the same backend. Both differ from eager alike where inductor's
    kernels round differently at a point where the math is not smooth (seed 7022: a LayerNorm of
    an arithmetic row gives two equal maxima in eager, one in inductor's bits, and ``amax``'s
    gradient splits between ties): a scan that matches the compiled loop computes what the loop
    does under this backend. A scan that differs from both fails here, naming the compiled loop (the
    eager loop's mismatch chained before it)."""
    torch._dynamo.reset()
    ref = materialize(p)
    loop_out = torch.compile(lambda init, xs: ref.observed(run_loop(p, ref.body, init, xs, ref.buffers)),
                             backend=backend, fullgraph=True)(ref.init, ref.xs)
    check(p, mode, "values (against the loop compiled alike)", out, loop_out)
    check(p, mode, "gradients (against the loop compiled alike)", got_grads, grads(ref.targets(), loop_out, weights))


def run_export(p, mode, want_out, want_grads, weights):
    inst = materialize(p)
    init_leaves, init_spec = pytree.tree_flatten(inst.init)
    xs_leaves, xs_spec = pytree.tree_flatten(inst.xs)
    n = len(init_leaves)

    kw = p.kwargs()
    if mode == "export_strict" and inst.buffers:  # Dynamo: as under torch.compile, documented
        kw = dict(kw, remat="save_all") if callable(kw["remat"]) else kw
        with pytest.raises(ScanError, match=r"closed-over tensor.*under torch.compile"):
            torch.export.export(_Call(lambda *a: scan(inst.body, *a, **kw)), (inst.init, inst.xs), strict=True)
        return
    if mode == "export_strict":
        kw = traceable_kwargs(p, inst, lambda f: lambda init, xs: torch.export.export(
            _Call(f), (init, xs), strict=True))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.closures = inst.module, inst.closures  # plain tensor attributes: constants
            for k, b in enumerate(inst.buffers):  # written: registered buffers
                self.register_buffer(f"K{k}", b.detach().clone())

        def buffers_written(self):
            return [getattr(self, f"K{k}") for k in range(len(inst.buffers))]

        def forward(self, *flat):
            init = pytree.tree_unflatten(list(flat[:n]), init_spec)
            xs = pytree.tree_unflatten(list(flat[n:]), xs_spec)
            lin = [self.lin] if self.lin is not None else []
            body = inst.make_body(*self.closures, *self.buffers_written(), *lin)
            return tuple(tensors(scan(body, init, xs, **kw)))

    def flat_args(i):
        return tuple(t if t is None else t.detach() for t in pytree.tree_leaves((i.init, i.xs)))

    ep = torch.export.export(M(), flat_args(inst), strict=mode == "export_strict")
    if mode == "export_saveload":
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        ep = torch.export.load(buf)
    module = ep.module()
    with torch.no_grad():
        got = list(module(*flat_args(materialize(p))))
    got += [getattr(module, f"K{k}") for k in range(len(inst.buffers))]  # the buffers written, after it
    check(p, mode, "values of the exported program (and buffers)", got, [t.detach() for t in tensors(want_out)])


class _Call(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, init, xs):
        return self.f(init, xs)


def run_xla(p, mode, want_out, want_grads, weights):
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")
    from torch_scan_hop.trace import shift
    inst = materialize(p, device=torch_xla.device())
    threshold, shift._MIN_ROW_BYTES = shift._MIN_ROW_BYTES, 0  # rebuild every saved carry it can, small rows too
    try:
        out = inst.observed(scan(inst.body, inst.init, inst.xs, **p.kwargs()))
        got_grads = grads(inst.targets(), out, weights)
    finally:
        shift._MIN_ROW_BYTES = threshold
    cpu = lambda tree: tmap(lambda t: t.detach().cpu(), tree)  # noqa: E731
    check(p, mode, "values on XLA", cpu(out), tmap(lambda t: t.detach(), want_out))
    check(p, mode, "gradients on XLA", cpu(got_grads), want_grads)


RUNNERS = {"func": run_func, "eager": run_eager, "make": run_make_fx, "compile": run_compile, "export": run_export,
           "xla": run_xla}

