"""Checks that tests/inductor/test_cpp_wrapper.py runs in a child interpreter (tests/support/_isolated.py): a
C++ wrapper that crashes (torch 2.9 segfaulted on a compiled scan with the global
``torch._inductor.config.cpp_wrapper = True``) then fails one test instead of killing pytest.

``how`` is ``"global"`` (the config set as a user sets it, restored afterwards) or ``"option"``
(``torch.compile(options={"cpp_wrapper": True})``): inductor routes the two differently, and only
the option used to reach our pass with ``config.cpp_wrapper`` on. Every check also asserts that
a C++ wrapper was built and that it never called the buffer pool's Python operator.
"""
import contextlib
import copy
import re

import torch
from conftest import assert_trees_close, reference_scan
from decoder import make_stack, run_loop

from torch_scan_hop import scan, scan_layers, stack_layers
from torch_scan_hop.inductor import buffer_pool


@contextlib.contextmanager
def _cpp_wrapper(how):
    """Compiles in the block get a C++ wrapper, set ``how``; yields ``compile(fn, **kw)``.
    Afterwards: at least one C++ wrapper was loaded, and no pooled buffer was asked for."""
    from torch._inductor import codecache, config

    loads, pool_calls = [], []
    load, take = codecache.CppWrapperCodeCache.load_pybinding.__func__, buffer_pool._buffers

    def counted_load(cls, *args, **kwargs):
        loads.append(1)
        return load(cls, *args, **kwargs)

    def counted_take(*args, **kwargs):
        pool_calls.append(1)
        return take(*args, **kwargs)

    def compile_(fn, **kw):
        return torch.compile(fn, options={"cpp_wrapper": True}, **kw) if how == "option" else torch.compile(fn, **kw)

    torch._dynamo.reset()
    saved = config.cpp_wrapper
    codecache.CppWrapperCodeCache.load_pybinding = classmethod(counted_load)
    buffer_pool._buffers = counted_take
    config.cpp_wrapper = how == "global"
    try:
        yield compile_
    finally:
        config.cpp_wrapper = saved
        codecache.CppWrapperCodeCache.load_pybinding = classmethod(load)
        buffer_pool._buffers = take
        torch._dynamo.reset()
    assert loads, "no C++ wrapper was compiled"
    assert not pool_calls, "a C++ wrapper called the buffer pool's Python operator"


def _grads(loss, inputs):
    return [loss.detach(), *torch.autograd.grad(loss, inputs)]


def check_issue_rnn(how):
    """Issue 40's tanh RNN (H=64, B=8, float32) at T=16 and 256 (each length compiled as a static
    one): forward, then a training step. The generated C++ runs each loop as a counted ``for``
    whose per-step buffers come from a pool made before it (``inductor.codegen.cpp_text``): no
    ``while (1)``, no cond kernel read back with ``aoti_torch_item_bool``."""
    from torch._inductor.utils import run_and_get_code

    def run(scan_fn, c0, xs, w):
        return scan_fn(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs)

    gen = torch.Generator().manual_seed(0)
    with _cpp_wrapper(how) as compile_:
        for t in (16, 256):
            torch._dynamo.reset()
            compiled = compile_(lambda c0, xs, w: run(scan, c0, xs, w))
            w = torch.randn(64, 64, generator=gen) * 0.1
            c0, xs = torch.randn(8, 64, generator=gen), torch.randn(t, 8, 64, generator=gen)
            got, codes = run_and_get_code(compiled, c0, xs, w)
            assert_trees_close(got, run(reference_scan, c0, xs, w))
            inputs = [a.requires_grad_() for a in (c0, xs, w)]
            got, more = run_and_get_code(lambda: _grads(sum(v.sum() for v in compiled(*inputs)), inputs))
            want = _grads(sum(v.sum() for v in run(reference_scan, *inputs)), inputs)
            assert_trees_close(got, want, atol=2e-4, rtol=1e-4)  # float32 sums of 256 steps
            code = "\n".join(codes + more)
            loops = re.findall(rf"for \(int64_t (\w+)_step = 0; \1_step < {t}; \+\+\1_step\)", code)
            assert len(loops) == 3, loops  # forward (twice: no grad, then with) and backward
            assert "while (1)" not in code and "aoti_torch_item_bool" not in code
            assert all(f"{loop}_pool0[{loop}_step & 1]" in code for loop in loops), "per-step buffers not pooled"


def _body(w):
    """Pytree carry {"h", "a"}, xs (x, s), ys (y, {"s"}): dict, tuple and a 1-D leaf."""
    def body(carry, x):
        h = torch.tanh(carry["h"] @ w + x[0])
        return {"h": h, "a": carry["a"] + h.sum(-1) * x[1]}, (h * w.sum(), {"s": carry["a"]})
    return body


def _loss(out):
    carry, (y, rest) = out
    return carry["h"].sum() + carry["a"].pow(2).sum() + y.pow(2).sum() + (rest["s"] * rest["s"].detach()).sum()


def check_training(how, remat, reverse, shapes, lengths):
    """Values and gradients of a compiled pytree scan against the loop. ``shapes``: "static",
    "dynamic" (``dynamic=True``) or "mark_dynamic" (the length marked dynamic)."""
    gen = torch.Generator().manual_seed(len(lengths))

    def scanned(scan_fn, c, xs, s, w):
        kw = {"remat": remat} if scan_fn is scan else {}
        return scan_fn(_body(w), {"h": c, "a": c.sum(-1)}, (xs, s), reverse=reverse, **kw)

    with _cpp_wrapper(how) as compile_:
        compiled = compile_(lambda *a: scanned(scan, *a), fullgraph=True, **({"dynamic": True} if shapes == "dynamic" else {}))
        for n in lengths:
            rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
            c, xs, s, w = rand(3, 4), rand(n, 3, 4), rand(n, 3), rand(4, 4)
            if shapes == "mark_dynamic":
                torch._dynamo.mark_dynamic(xs, 0)
                torch._dynamo.mark_dynamic(s, 0)
            inputs = [a.requires_grad_() for a in (c, xs, s, w)]
            got, want = compiled(*inputs), scanned(reference_scan, *inputs)
            assert_trees_close(got, want)
            assert_trees_close(_grads(_loss(got), inputs), _grads(_loss(want), inputs))


def check_scan_layers(how, stacked):
    """A scan_layers training step (decoder blocks) against the loop of layers."""
    base = make_stack(3, 32, 4)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    layers = stack_layers(copy.deepcopy(base)) if stacked else copy.deepcopy(base)
    with _cpp_wrapper(how) as compile_:
        out = compile_(lambda l, x: scan_layers(l, x))(layers, x)
        out.pow(2).mean().backward()
    ref = run_loop(base, x)
    ref.pow(2).mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(layers.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


class Rnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, c, xs):
        return scan(lambda c, x: (torch.tanh(c @ self.w + x), c.sum(-1)), c, xs, reverse=True)


class Bptt(torch.nn.Module):
    """A training step written out with two scans, for an exported program (which cannot
    hold autograd): the tanh RNN forward, then its backward as a reverse scan carrying
    ``{"dh", "dw"}`` over the pytree ``(hs, previous hs)``. Returns the loss
    ``hT.sum() + hs.pow(2).sum()`` and its gradients for (w, c, xs)."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64) * 0.5)

    def forward(self, c, xs):
        w = self.w
        h_last, hs = scan(lambda h, x: (torch.tanh(h @ w + x),) * 2, c, xs)
        before = torch.cat([c[None], hs[:-1]])

        def backward_step(grads, step):
            h, h_before = step
            da = (grads["dh"] + 2 * h) * (1 - h * h)
            return {"dh": da @ w.T, "dw": grads["dw"] + h_before.T @ da}, da

        init = {"dh": torch.ones_like(h_last), "dw": torch.zeros_like(w)}
        grads, dxs = scan(backward_step, init, (hs, before), reverse=True)
        return h_last.sum() + hs.pow(2).sum(), grads["dw"], grads["dh"], dxs


def check_aot_inductor(tmp_dir):
    """``aoti_compile_and_package`` of exported scans, loaded and run twice (the second call
    reuses the runner's buffers) against eager: a reverse scan, and a training step written
    as two scans with pytrees, its length a ``Dim``, checked against autograd of the loop."""
    gen = torch.Generator().manual_seed(2)
    model = Rnn()
    ep = torch.export.export(model, (torch.randn(3, 4), torch.randn(5, 3, 4)))
    runner = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp_dir}/rnn.pt2"))
    for _ in range(2):
        c, xs = torch.randn(3, 4, generator=gen), torch.randn(5, 3, 4, generator=gen)
        assert_trees_close(tuple(runner(c, xs)), tuple(model(c, xs)))

    model = Bptt()
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    length = torch.export.Dim("length", min=3, max=64)  # 2 would specialize: hs[:-1] of length 1
    ep = torch.export.export(model, (rand(3, 4), rand(5, 3, 4)), dynamic_shapes=({}, {0: length}))
    runner = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp_dir}/bptt.pt2"))
    for n in (5, 9):
        c, xs = rand(3, 4).requires_grad_(), rand(n, 3, 4).requires_grad_()
        h, hs = reference_scan(lambda h, x: (torch.tanh(h @ model.w + x),) * 2, c, xs)
        want = _grads(h.sum() + hs.pow(2).sum(), (model.w, c, xs))
        with torch.no_grad():
            got = list(runner(c, xs))
            assert_trees_close(got, [t.detach() for t in model(c, xs)])
        assert_trees_close(got, want)


def check_aot_inductor_without_scan(tmp_dir):
    """The same packaging of a Python-loop RNN, no scan anywhere: where ``check_aot_inductor``
    kills its interpreter, this one tells whether AOTInductor itself does on this machine
    (torch 2.11+cu130 on a GPU machine segfaults loading any package)."""
    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, h, xs):
            for i in range(xs.shape[0]):
                h = torch.tanh(h @ self.w + xs[i])
            return h

    model, args = Loop(), (torch.randn(3, 4), torch.randn(5, 3, 4))
    ep = torch.export.export(model, args)
    runner = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp_dir}/loop.pt2"))
    assert_trees_close(runner(*args), model(*args))


def check_nested(how):
    """A scan whose body runs a scan (static lengths 3 and 4), values and gradients as the
    loop's: both loops are counted ``for`` loops whose per-step buffers are pooled, each
    loop its own (an inner loop's allocations, made several times an outer step, once came
    from the outer's pool: silently wrong values)."""
    from torch._inductor.utils import run_and_get_code

    def run(scan_fn, c0, xs, w):
        def outer(c, x):
            inner_c, ys = scan_fn(lambda h, v: (torch.tanh(h @ w + v), h.sum(-1)), c, x)
            return inner_c * 0.5 + c, ys.sum(0)
        return scan_fn(outer, c0, xs)

    gen = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    c0, xs, w = rand(2, 5), rand(3, 4, 2, 5), rand(5, 5) * 0.3
    with _cpp_wrapper(how) as compile_:
        compiled = compile_(lambda c0, xs, w: run(scan, c0, xs, w), fullgraph=True)
        inputs = [a.requires_grad_() for a in (c0, xs, w)]
        got, codes = run_and_get_code(lambda: _grads(sum(v.sum() for v in compiled(*inputs)), inputs))
        assert_trees_close(got, _grads(sum(v.sum() for v in run(reference_scan, *inputs)), inputs))
    code = "\n".join(codes)
    for t in (3, 4):
        assert re.search(rf"for \(int64_t \w+_step = 0; \w+_step < {t};", code), f"no counted loop of {t} steps"
    assert "while (1)" not in code


def check_blas_mm_matches_aten(how):
    """Float32 matmuls in a counted loop call BLAS directly (``inductor.codegen.cpp_text``) and give
    ATen's mm's numbers to the bit, for the layouts ATen itself hands to BLAS: a row-major
    weight, a transposed one on either side, a batch of 1 (size-1 dims), and shapes whose m, n,
    k all differ.
    The step is matmuls and an exact scale only, so the loop's own torch.mm gives the same bits.
    MKL's ``sgemm_`` whatever the CPU (``SCAN_SMALL_GEMM=0``): ``small_gemm``, on by default where MKL
    runs no AVX-512, is not ATen's to the bit (``check_small_gemm``)."""
    from unittest import mock

    from torch._inductor.utils import run_and_get_code

    from torch_scan_hop.inductor.codegen import small_gemm

    def run(scan_fn, c0, xs, w1, w2):
        return scan_fn(lambda c, x: (((c @ w1) @ w2.t()) * 0.5 + x, (c, x.t() @ c)), c0, xs)

    gen = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    for batch in (5, 1):
        c0, xs, w1, w2 = rand(batch, 6), rand(4, batch, 6), rand(6, 3), rand(6, 3)
        with _cpp_wrapper(how) as compile_, mock.patch.dict("os.environ", {small_gemm.ENV: "0"}):
            compiled = compile_(lambda *a: run(scan, *a), fullgraph=True)
            got, codes = run_and_get_code(compiled, c0, xs, w1, w2)
        want = run(reference_scan, c0, xs, w1, w2)
        got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), [(g - w).abs().max() for g, w in zip(got, want)]
        loop = codes[0][codes[0].index("for (int64_t "):]
        assert loop.count("scan_blas_mm_out(") == (3 if batch > 1 else 2)  # x.t() @ c of a batch of 1: a product


def matmul_body_problem(batch, hidden, inputs):
    """``(run, leaves)``: a trained scan whose body has each kind of product the loops hand BLAS (a
    weight on either side, transposed or not, a Linear's bias, a carry's transpose times the input),
    64 steps; ``run(scan_fn, *leaves)`` gives ``(loss, (carry, ys))`` (``scan_fn``: ours or the loop)."""
    gen = torch.Generator().manual_seed(batch * 100 + hidden)
    w, v = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5, torch.randn(hidden, inputs, generator=gen) / inputs ** 0.5
    b, c0, xs = torch.randn(hidden, generator=gen), torch.randn(batch, hidden, generator=gen), torch.randn(64, batch, inputs, generator=gen)

    def run(scan_fn, w, v, b, c0, xs):
        def step(c, x):
            c = torch.tanh(c @ w.t() * 0.5 + torch.nn.functional.linear(x, v, b) + c @ w)
            return c, c.t() @ x
        c, ys = scan_fn(step, c0, xs)
        return c.sum() + (ys * torch.linspace(-1, 1, inputs)).sum(), (c, ys)

    return run, [t.requires_grad_() for t in (w, v, b, c0, xs)]


def check_small_gemm(how, on, batch, hidden, inputs):
    """A body with each kind of product a loop hands ``scan_blas_mm_out`` (a weight on either side,
    transposed or not, a carry's transpose times the input; a Linear's bias, which stays ATen's
    addmm) at sizes off small_gemm's register blocks, 64 steps, trained: values and gradients
    against the loop in float64, and each mm call rewritten in the C++ wrapper's loops counted as
    ``small_gemm`` applied (``on``: the helper computes it with small_gemm's kernel, defined in the
    wrapper's header) or skipped (the helper is ``sgemm_``'s alone). The child's ``SCAN_SMALL_GEMM``
    decides ``on``."""
    from torch._inductor.utils import run_and_get_code

    from torch_scan_hop.inductor import codegen
    from torch_scan_hop.inductor.codegen import small_gemm

    assert small_gemm.enabled() == on
    run, inputs_ = matmul_body_problem(batch, hidden, inputs)
    codegen.reset_pass_counts()
    with _cpp_wrapper(how) as compile_, torch._inductor.config.patch(force_disable_caches=True):
        compiled = compile_(lambda *a: run(scan, *a), fullgraph=True)
        (loss, outs), codes = run_and_get_code(compiled, *inputs_)
        grads, more = run_and_get_code(lambda: torch.autograd.grad(loss, inputs_))
    doubles = [t.detach().double().requires_grad_() for t in inputs_]
    loss64, outs64 = run(reference_scan, *doubles)
    want = tuple(t.float() for t in outs64), tuple(g.float() for g in torch.autograd.grad(loss64, doubles))
    assert_trees_close((outs, grads), want, rtol=1e-4, atol=1e-4)
    code = "\n".join(codes + more)
    calls = code.count("AOTI_TORCH_ERROR_CODE_CHECK(scan_blas_mm_out(")
    assert calls >= 6, calls  # 3 forward, 3+ backward
    counts = codegen.pass_counts()[small_gemm.NAME]
    assert counts == {"applied": calls if on else 0, "skipped": 0 if on else calls, "failed": 0}, (counts, calls)
    assert code.count("if (!scan_small_gemm::sgemm(ta, tb, m, n, k, ") == (2 if on else 0)  # each wrapper's helper
    assert (small_gemm.NAMESPACE in code.split("\n")) == on
