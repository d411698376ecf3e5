"""Checks of the pointwise scan kernel (``inductor/codegen/triton_scan``, ``inductor/pointwise_scan``) that run
its generated Triton source on the CPU, under Triton's interpreter: a child interpreter started with
``TRITON_INTERPRET=1`` (tests/support/_isolated.py), since Triton reads it once, at import.

``check_generator``: a body traced to aten (make_fx), its kernel source generated and run through the
operator, against the Python loop of the same body. ``check_compiled``: torch.compile (inductor) of a
forward and a training step with the pass allowed on CPU tensors (``DEVICE_TYPES``), values and float64
gradients against the loop, the pass applied to the forward and the backward scan, and the wrapper
calling the operator with no loop over steps; ``check_compiled_beside_inductor_triton_kernels``: the same
with inductor's kernels in Triton as well, the wrapper a GPU gets.
"""
import math

import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan
from torch_scan_hop.inductor import pointwise_scan
from torch_scan_hop.inductor.codegen import pass_counts, reset_pass_counts, triton_scan

T, B, D, N = 19, 3, 5, 4  # 19: two unrolled iterations of 8 steps and 3 single steps; N: Mamba's state size


def _linear(c, x, w):
    (h,), (a, b) = c, x
    h = a * h + b
    return [h], [h]


def _rglru(c, x, w):
    """RG-LRU: a gated diagonal recurrence, its decay from a closed-over parameter (broadcast over the
    batch) and a gate row broadcast over the batch too."""
    (h,), (xt, ga, gx), (lam,) = c, x, w
    log_a = -8.0 * torch.sigmoid(ga) * torch.log1p(torch.exp(lam))
    a = torch.exp(log_a)
    h = a * h + torch.sqrt(1 - a * a) * (torch.sigmoid(gx) * xt)
    return [h], [h, torch.tanh(h)]


def _wkv(c, x, w):
    """RWKV-4's wkv: numerator, denominator and running max as three carries."""
    (aa, bb, pp), (k, v), (decay, bonus) = c, x, w
    ww = bonus + k
    p = torch.maximum(pp, ww)
    e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
    y = (e1 * aa + e2 * v) / (e1 * bb + e2)
    ww = pp - torch.exp(decay)
    p = torch.maximum(ww, k)
    e1, e2 = torch.exp(ww - p), torch.exp(k - p)
    return [e1 * aa + e2 * v, e1 * bb + e2, p], [y]


def _mixed(c, x, w):
    """Several carries and ys, one carry returned unchanged, an x returned as a y, a where, a clamp,
    a 0-d and a column closed-over tensor, an x row broadcast over the batch."""
    (c1, c2), (xt, row), (s, col) = c, x, w
    new1 = torch.where(xt > 0, c1 * 0.5 + s, torch.tanh(c2) * col) + row
    y2 = torch.clamp(c1, -1.0, 1.0) ** 2 - torch.relu(-c2)
    y3 = torch.rsqrt(torch.abs(c1 - c2) + 1) + torch.expm1(torch.minimum(row, xt)) / 4
    return [new1, c2], [xt, y2, y3.to(c1.dtype)]


def _mamba(c, x, w):
    """Mamba's selective scan with the contraction over N in the body: E = (B, D, N) from the carry,
    the y row (B, D) a sum over E's last dim, C_t (B, N) placed onto E by its unsqueeze (and in the
    backward, the y's gradient row (B, D) by its unsqueeze(-1), C_t's gradient a (B, N) sum over D)."""
    (h,), (da, dbu, ct) = c, x
    h = da * h + dbu
    return [h], [(h * ct[:, None, :]).sum(-1)]


def _inputs(case, dtype, strided=False, t=T):
    g = torch.Generator().manual_seed(0)

    def r(*shape, positive=False):
        t = torch.rand(*shape, generator=g, dtype=dtype) if positive else torch.randn(*shape, generator=g, dtype=dtype)
        return t

    if case == "linear":
        return [r(B, D)], [r(t, B, D, positive=True), r(t, B, D)], []
    if case == "rglru":
        return [r(B, D)], [r(t, B, D), r(t, B, D), r(t, 1, D)], [r(D)]
    if case == "wkv":
        return [torch.zeros(B, D, dtype=dtype), torch.zeros(B, D, dtype=dtype), torch.full((B, D), -1e30, dtype=dtype)], \
            [r(t, B, D), r(t, B, D)], [r(D), r(D)]
    if case == "mamba":
        return [r(B, D, N)], [r(t, B, D, N, positive=True), r(t, B, D, N), r(t, B, N)], []
    if case == "mixed":
        init, xs, lifted = [r(B, D), r(B, D)], [r(t, B, D), r(t, D)], [r(()), r(B, 1)]
        if strided:  # non-contiguous init, xs and an expanded (stride 0) closed-over tensor
            init[0] = r(D, B).t()
            xs[0] = r(B, t, D).transpose(0, 1)
            lifted[1] = r(B, 1)[:, :1].expand(B, 1)
        return init, xs, lifted
    raise ValueError(case)


BODIES = {"linear": _linear, "rglru": _rglru, "wkv": _wkv, "mixed": _mixed, "mamba": _mamba}


def _loop(body, init, xs, lifted, reverse):
    n = xs[0].shape[0]
    carry, ys = list(init), [None] * n
    for t in (reversed(range(n)) if reverse else range(n)):
        carry, ys[t] = body(carry, [x[t] for x in xs], lifted)
    return [*carry, *(torch.stack(col) for col in zip(*ys))]


def _generated(case, dtype, reverse, strided=False):
    """(kernel source, init, xs, closed-over tensors, the loop's outputs) of a case's body."""
    body = BODIES[case]
    init, xs, lifted = _inputs(case, dtype, strided)
    nc, nx = len(init), len(xs)

    def flat_body(*flat):
        new, ys = body(list(flat[:nc]), list(flat[nc:nc + nx]), list(flat[nc + nx:]))
        return [*new, *ys]

    graph = make_fx(flat_body, tracing_mode="fake")(*init, *(x[0] for x in xs), *lifted)
    want = _loop(body, init, xs, lifted, reverse)
    element = pointwise_scan._element_shape([c.shape for c in init], [y.shape[1:] for y in want[nc:]])
    sig = triton_scan.Signature(
        element_shape=element, length=T, carries=tuple(triton_scan.Leaf(tuple(c.shape), c.dtype) for c in init),
        xs=tuple(triton_scan.Leaf(tuple(x.shape[1:]), x.dtype) for x in xs),
        lifted=tuple(triton_scan.Leaf(tuple(w.shape), w.dtype) for w in lifted),
        ys=tuple(triton_scan.Leaf(tuple(v.shape[1:]), v.dtype) for v in want[nc:]), reverse=reverse)
    return triton_scan.kernel_source(graph, sig), init, xs, lifted, want


def check_generator(case, dtype_name, reverse, strided=False):
    dtype = getattr(torch, dtype_name)
    source, init, xs, lifted, want = _generated(case, dtype, reverse, strided)
    nc = len(init)
    got = torch.ops.torch_scan_hop.pointwise_scan(source, init, xs, lifted, reverse)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.is_contiguous() and g.shape == w.shape and g.dtype == w.dtype, (k, g.shape, w.shape)
        torch.testing.assert_close(g, w, **tol, msg=lambda m, k=k: f"output {k}: {m}")


_POINTERS = {torch.float32: "*fp32", torch.float64: "*fp64", torch.bfloat16: "*bf16", torch.float16: "*fp16",
             torch.bool: "*i1"}


def check_compiles_for_cuda(case, dtype_name, reverse):
    """The generated source compiled by Triton for an sm_90 GPU (no GPU needed: Triton's own compiler
    and ptxas), with the arguments the operator launches it with: what the interpreter cannot check
    (libdevice, loop-carried types, constexpr arithmetic, the unrolled loads)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source, init, xs, lifted, _want = _generated(case, getattr(torch, dtype_name), reverse)
    info, kernel = pointwise_scan._kernel(source)
    carries, ys = pointwise_scan._outputs_like(info, init, xs, lifted)
    args = [*init, *xs, *lifted, *pointwise_scan._partials(info, [*carries, *ys]), T]  # T: a launch argument
    consts = {**pointwise_scan._strides(init, xs, lifted), "N": math.prod(info["E"]), "BLOCK": 32}
    names = kernel.arg_names
    assert names[:len(args)] == [n for n in names if n not in consts] and len(names) == len(args) + len(consts)
    assert names[len(args) - 1] == "T", names
    signature = {n: _POINTERS[a.dtype] for n, a in zip(names, args[:-1])} | {"T": "i32"} \
        | {n: "constexpr" for n in names[len(args):]}
    constexprs = {(i,): consts[n] for i, n in enumerate(names) if n in consts}
    compiled = triton_compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 1})
    assert "ld.global" in compiled.asm["ptx"] and compiled.asm["cubin"]


def _training_inputs(case, device, dtype, t=T):
    init, xs, lifted = _inputs(case, torch.float64, t=t)
    return [t.to(device, dtype).requires_grad_() for t in (*init, *xs, *lifted)], len(init), len(xs)


def check_compiled(case, reverse, device="cpu", dtype_name="float64"):
    """Forward and training step compiled with inductor, both scans replaced by the kernel. On the
    CPU only under the interpreter (the pass is allowed on CPU tensors here); on CUDA as users run it."""
    if device == "cpu":
        pointwise_scan.DEVICE_TYPES.add("cpu")
    torch._dynamo.reset()
    dtype = getattr(torch, dtype_name)
    body = BODIES[case]
    leaves, nc, nx = _training_inputs(case, device, dtype)

    def run(*flat):
        init, xs, lifted = list(flat[:nc]), list(flat[nc:nc + nx]), list(flat[nc + nx:])

        def step(carry, x):
            new, ys = body(list(carry), list(x), lifted)
            return new, ys

        carry, ys = scan(step, init, xs, reverse=reverse)
        return [*carry, *ys]

    reset_pass_counts()
    got, codes = run_and_get_code(torch.compile(run), *leaves)
    want = _loop(body, leaves[:nc], leaves[nc:nc + nx], leaves[nc + nx:], reverse)
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    weights = [torch.randn(w.shape, generator=torch.Generator().manual_seed(k)).to(w) for k, w in enumerate(want)]
    grads, backward = run_and_get_code(
        lambda: torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), leaves))
    expect = torch.autograd.grad(sum((g * w).sum() for g, w in zip(want, weights)), leaves)
    torch.testing.assert_close(grads, expect, **tol)
    counts = pass_counts()[pointwise_scan.PASS_NAME]
    assert counts == {"applied": 2, "skipped": 0, "failed": 0}, counts  # forward and backward scan
    assert len(codes) == len(backward) == 1
    for code in (*codes, *backward):
        assert "torch.ops.torch_scan_hop.pointwise_scan.default(" in code, code[-3000:]
        assert "while_loop" not in code and "_step in range(" not in code, code[-3000:]
    return [*codes, *backward]


def check_compiled_beside_inductor_triton_kernels(case, reverse):
    """``check_compiled`` with inductor's own kernels written in Triton too (``cpu_backend="triton"``,
    hashed for an sm_90 target, run by the interpreter): the wrapper inductor writes for a GPU, our
    operator beside ``async_compile.triton`` kernels. There inductor copies the scan node's text into
    comments; a kernel source travelling as multi-line text broke the wrapper's Python (an H200's
    "SyntaxError: unmatched ')'" for the training steps of these bodies), hence ``pointwise_scan.pack``."""
    import torch.utils._triton as triton_utils
    from torch._inductor import config
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    triton_utils.triton_backend = lambda: CUDABackend(GPUTarget("cuda", 90, 32))  # no CPU driver to ask
    with config.patch(cpu_backend="triton"):
        codes = check_compiled(case, reverse)
    assert any("async_compile.triton(" in code for code in codes), "no inductor Triton kernel beside ours"


def check_compiled_symbolic_length(case, reverse):
    """A length Dynamo traces as a symbol (``mark_dynamic``): one compiled graph, the kernel in its
    forward and backward scans, right for two lengths (T is a launch argument of the kernel)."""
    pointwise_scan.DEVICE_TYPES.add("cpu")
    torch._dynamo.reset()
    body = BODIES[case]
    nc, nx = None, None

    def run(*flat):
        init, xs, lifted = list(flat[:nc]), list(flat[nc:nc + nx]), list(flat[nc + nx:])
        carry, ys = scan(lambda c, x: body(list(c), list(x), lifted), init, xs, reverse=reverse)
        return [*carry, *ys]

    reset_pass_counts()
    compiled = torch.compile(run)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for k, t in enumerate((T, T + 6)):
            leaves, nc, nx = _training_inputs(case, "cpu", torch.float64, t=t)
            for x in leaves[nc:nc + nx]:
                torch._dynamo.mark_dynamic(x, 0)
            with torch._dynamo.config.patch(error_on_recompile=k > 0):
                got = compiled(*leaves)
            want = _loop(body, leaves[:nc], leaves[nc:nc + nx], leaves[nc + nx:], reverse)
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
            grads = torch.autograd.grad(sum(g.sum() for g in got), leaves)
            expect = torch.autograd.grad(sum(w.sum() for w in want), leaves)
            torch.testing.assert_close(grads, expect, atol=1e-10, rtol=1e-10)
    counts = pass_counts()[pointwise_scan.PASS_NAME]
    assert counts == {"applied": 2, "skipped": 0, "failed": 0}, counts  # one forward, one backward


def check_bfloat16_forward(case, reverse, device):
    """bfloat16 inputs: computed in float32 in the kernel, the carry rounded to bfloat16 every step as
    the loop stores it; against the loop in float32 from the same bfloat16 values."""
    torch._dynamo.reset()
    body = BODIES[case]
    init, xs, lifted = (
        [t.to(device, torch.bfloat16) for t in group] for group in _inputs(case, torch.float32))

    def run(init, xs, lifted):
        return scan(lambda c, x: body(list(c), list(x), lifted), init, xs, reverse=reverse)

    reset_pass_counts()
    carry, ys = torch.compile(run)(init, xs, lifted)
    want = _loop(body, *([t.float() for t in g] for g in (init, xs, lifted)), reverse)
    torch.testing.assert_close([t.float() for t in (*carry, *ys)], want, atol=5e-2, rtol=5e-2)
    assert pass_counts()[pointwise_scan.PASS_NAME]["applied"] == 1
