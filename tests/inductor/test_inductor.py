"""Inductor against the Python loop: every schedule (unroll blocks, remainder, reverse), values and
gradients of init, xs and closures; the torch 2.9 inductor defects the scan's loops must survive."""
import os

import pytest
import torch
from conftest import assert_trees_close, loops_in, reference_scan
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan

# Each length stresses a different schedule for unroll 2 and 3 (and 8 in the full sweep): one step,
# fewer steps than a block, an exact number of blocks (9 for 3), remainder steps (19 also under the default).
LENGTHS = (1, 2, 9, 19)
FULL_SWEEP = os.environ.get("TORCH_SCAN_HOP_FULL_SWEEP") == "1"  # lengths 1..20: ~30 min on 2 cores


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def rnn_cell(w, b):
    def cell(c, x):
        h = torch.tanh(c @ w + x + b)
        return h, h * x
    return cell


def problems(lengths):
    """Per length and direction: fresh init, xs, closed-over weight and bias, random cotangents.
    Forward scans take no gradient for xs, so their backward loops have no ys of their own (the
    proxy rule adds a dummy scalar per step)."""
    gen = torch.Generator().manual_seed(len(lengths))
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return [dict(c0=rand(2, 2), xs=rand(n, 2, 2), w=rand(2, 2), b=rand(2), reverse=reverse,
                 g_c=rand(2, 2), g_ys=rand(n, 2, 2)) for n in lengths for reverse in (False, True)]


def loop(w, b, c0, xs, reverse):
    """The reference: the Python for-loop."""
    c, ys = c0, [None] * xs.shape[0]
    for i in (reversed(range(xs.shape[0])) if reverse else range(xs.shape[0])):
        c, ys[i] = rnn_cell(w, b)(c, xs[i])
    return c, torch.stack(ys)


def values_and_grads(run, probs):
    """Outputs and the gradients of init, weight, bias (and xs for reverse scans) of every problem,
    through ``run`` (one call for all problems: one compiled graph instead of one per length)."""
    grad_keys = lambda p: ("c0", "xs", "w", "b") if p["reverse"] else ("c0", "w", "b")  # noqa: E731
    leaves = [{k: p[k].clone().requires_grad_(k in grad_keys(p)) for k in ("c0", "xs", "w", "b")} for p in probs]
    outs = run([(p["w"], p["b"], p["c0"], p["xs"], q["reverse"]) for p, q in zip(leaves, probs)])
    flat_outs = [t for pair in outs for t in pair]
    cotangents = [t for p in probs for t in (p["g_c"], p["g_ys"])]
    inputs = [p[k] for p, q in zip(leaves, probs) for k in grad_keys(q)]
    grads = torch.autograd.grad(flat_outs, inputs, cotangents)
    return [o.detach() for o in flat_outs], list(grads)


@pytest.mark.parametrize("unroll", [1, 2, 3, None] + ([8] if FULL_SWEEP else []))
def test_inductor_matches_loop_for_every_schedule(unroll):
    """Forward and reverse scans of every length, in one compiled graph. (Wrong closure gradients
    with a remainder depended on buffer sizes: test_loop_bodies_never_write_into_their_inputs.)"""
    probs = problems(tuple(range(1, 21)) if FULL_SWEEP else LENGTHS)

    def scans(args):
        return [scan(rnn_cell(w, b), c0, xs, unroll=unroll, reverse=reverse) for w, b, c0, xs, reverse in args]

    want = values_and_grads(lambda args: [loop(*a) for a in args], probs)
    got = values_and_grads(torch.compile(scans, backend="inductor", fullgraph=True), probs)
    assert_trees_close(got, want, atol=2e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_loop_bodies_never_write_into_their_inputs():
    """torch 2.9 lowered a while_loop body of a backward graph with the backward's donated-input
    indices applied to the body's own inputs (fixed upstream by pytorch#193960): the body wrote its
    new carry into a carried input's storage, the outer graph then reused that storage for the next
    loop's ys buffer, and the closure gradient was overwritten. No body may reuse an input buffer."""
    torch.manual_seed(0)
    w, b = torch.randn(3, 3, requires_grad=True), torch.randn(3, requires_grad=True)

    def step(c0, xs):
        c, ys = scan(rnn_cell(w, b), c0, xs, unroll=2)
        return torch.autograd.grad(c.pow(2).sum() + ys.pow(2).sum(), (w, b))

    c0, xs = torch.randn(2, 3), torch.randn(7, 2, 3)
    got, codes = run_and_get_code(torch.compile(step, backend="inductor"), c0, xs)
    assert_trees_close(got, step(c0, xs), atol=1e-5, rtol=1e-4)
    code = "\n".join(codes)
    assert loops_in(code) == 4  # forward and backward: blocks of 2 and a remainder step
    reused_inputs = [line for line in code.splitlines() if "# reuse" in line and "_graph_" in line
                     and "_arg" in line.split("=")[-1]]
    assert reused_inputs == []


@pytest.mark.parametrize("dynamic", [False, True])
def test_static_lengths_loop_with_no_cond_call(dynamic):
    """A scan of static length runs its body in a ``for ... in range(L)`` (no cond subgraph call,
    bool buffer or tensor-to-bool per step); a dynamic length keeps inductor's while loop, whose
    cond reads the length at run time. Values and gradients of the loop either way, lengths 1..3."""
    torch.manual_seed(0)
    w, b = torch.randn(3, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)

    def step(c0, xs):
        c, ys = scan(rnn_cell(w, b), c0, xs)
        return [c, ys, *torch.autograd.grad(c.pow(2).sum() + ys.pow(2).sum(), (w, c0, xs))]

    compiled = torch.compile(step, backend="inductor", dynamic=dynamic)
    for n in (3, 1, 2):
        c0 = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
        xs = torch.randn(n, 2, 3, dtype=torch.float64, requires_grad=True)
        got, codes = run_and_get_code(compiled, c0, xs)
        assert_trees_close(got, step(c0, xs), atol=1e-10, rtol=1e-10)
        code = "\n".join(codes)
        counted = code.count(f"_step in range({n}):") == 2 and "while " not in code and "cond_result" not in code
        looped = code.count("while ") == 2 and "_step in range(" not in code
        if codes:  # the pool's outputs are made as its fake kernel says: not asserted after each call
            assert "stacked_buffers.default')" not in code
        if n == 3:  # small ys of a static length are plain empty_strided (the pool would keep none)
            assert ("stacked_buffers.default(" in code) == dynamic
        if counted:  # the body inlined, its index the loop variable: no function call or .item() per step
            assert ".item()" not in code and "_body_graph_0_0(" not in code, code[-3000:]
        if n == 3:  # compiled now: forward and backward loop
            assert counted if not dynamic else looped
        elif codes:  # a recompile (static: each length; dynamic: length 1 is specialized)
            assert counted or (dynamic and looped)


@pytest.mark.parametrize("reverse", [False, True])
def test_plain_sum_losses_compile(reverse):
    """``carry.sum() + ys.sum()`` makes the backward's loop operands expanded (stride-0) views,
    which torch 2.9's while_loop lowering cannot take: they are materialized first."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    c0, xs = torch.randn(2, 3, requires_grad=True), torch.randn(5, 2, 3, requires_grad=True)

    def step(c0, xs):
        c, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs, reverse=reverse, unroll=2)
        return torch.autograd.grad(c.sum() + ys.sum(), (c0, xs, w))

    assert_trees_close(torch.compile(step, backend="inductor")(c0, xs), step(c0, xs), atol=1e-5, rtol=1e-4)


def test_expanded_xs_in_forward():
    """An expanded xs (one row for every step) reaches the forward loop as a stride-0 operand."""
    row = torch.randn(1, 3)

    def f(c0):
        return scan(lambda c, x: (torch.sin(c) + x, c * 2), c0, row.expand(6, 3))

    c0 = torch.randn(3)
    assert_trees_close(torch.compile(f, backend="inductor")(c0), f(c0))


@pytest.mark.parametrize("b_step", ["used", "passed_through"])
def test_mixed_float64_float32_carry_trains_with_unroll(b_step):
    """The loss's gradient for the float32 carry is a slice of the float64/float32 cat's gradient,
    12 bytes into its buffer: a loop body writing its new carry gradient into that (donated) input
    ("used"), or returning the input itself ("passed_through": b is not changed, so neither is its
    gradient), made the loop's result unaligned and inductor asserted "16 bytes aligned"."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    a0, b0 = torch.randn(3, dtype=torch.float64, requires_grad=True), torch.randn(3, requires_grad=True)
    xs = torch.randn(7, 3, requires_grad=True)

    def cell(c, x):
        a, b = c
        return (torch.tanh(a @ w + x.double()), b), a.float() * (b if b_step == "used" else 2)

    def step(a0, b0, xs):
        (a, b), ys = scan(cell, (a0, b0), xs, unroll=2)
        loss = torch.cat([a.float(), b]).pow(2).sum() + ys.pow(2).sum()
        return torch.autograd.grad(loss, (a0, b0, xs, w))

    assert_trees_close(torch.compile(step, backend="inductor")(a0, b0, xs), step(a0, b0, xs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("unroll", [2, 3])
def test_gradient_accumulator_the_body_passes_through(unroll):
    """A closure the body reads only through argmax gets no gradient: the backward loops carry
    its zero accumulator through unchanged, so each loop's output IS its input. Inductor freed
    the first loop's input after it and gave its storage to the remainder loop's ys: the
    closure's gradient came out as a row of xs's (fuzz seed 9001; torch 2.9 and 2.15)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    xs = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    cotangent = torch.randn(7, 2, dtype=torch.float64, generator=g)

    def body(c, x):
        r = x.expand(2, 3)
        return c, ((r * w).argmax(-1), r.sum(-1))

    def run(f):
        _, (idx, s) = f(torch.zeros(2, 3, dtype=torch.float64), xs)
        loss = (s * cotangent).sum()
        return [idx, s.detach(), *torch.autograd.grad(loss, [w, xs], allow_unused=True, materialize_grads=True)]

    compiled = torch.compile(lambda c, xs: scan(body, c, xs, unroll=unroll), backend="inductor", fullgraph=True)
    assert_trees_close(run(compiled), run(lambda c, xs: reference_scan(body, c, xs)))


def test_mutated_carries_listed_in_write_order_keep_their_outputs(monkeypatch, fresh_dynamo):
    """torch 2.10-2.11 list the carries a while_loop body mutates in the order it writes
    them; 2.11's ``WhileLoop.create`` paired that list with the outputs in index order, so
    every compiled scan's ys came back as its loop counter (a scan writes its ys rows before
    it steps the counter). Here 2.9 and 2.15 are given that order (reversed) as well."""
    import torch._higher_order_ops.utils as hop_utils

    check = hop_utils.check_input_alias_and_mutation

    def in_write_order(*args, **kwargs):
        *maps, mutated = check(*args, **kwargs)
        return (*maps, sorted(mutated, reverse=True))

    monkeypatch.setattr(hop_utils, "check_input_alias_and_mutation", in_write_order)
    w = torch.randn(4, 4)
    body = lambda c, x: (torch.tanh(c @ w + x), (c.sum(-1), c * 2))  # noqa: E731
    c0, xs = torch.randn(3, 4), torch.randn(5, 3, 4)
    compiled = torch.compile(lambda c0, xs: scan(body, c0, xs), backend="inductor", fullgraph=True)
    assert_trees_close(compiled(c0, xs), reference_scan(body, c0, xs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_carry_returned_in_another_layout(reverse, dynamic):
    """A body whose new carry is a transpose of a square result: the loop keeps its values in any
    layout, but while_loop requires each carry to keep its strides (the Kalman filter's covariance)."""
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    c0, xs = torch.randn(2, 3, 3, requires_grad=True), torch.randn(4, 2, 3, 3)

    def step(c0, xs):
        c, ys = scan(lambda c, x: ((c @ w + x).mT.tanh(), c.sum()), c0, xs, reverse=reverse)
        return torch.autograd.grad(c.pow(2).sum() + ys.sum(), (c0, w))

    compiled = torch.compile(step, backend="inductor", dynamic=dynamic)
    assert_trees_close(compiled(c0, xs), step(c0, xs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_loop_subgraphs_do_not_assert_their_inputs_every_iteration(dynamic):
    """The body of our loops runs once per step; asserting every carried input's size and stride
    there cost ~140 asserts per decoder layer of a training step. Static and dynamic lengths alike
    inline the body into a counted for loop (the cond is never generated)."""
    w, b, c0, xs = torch.randn(2, 2), torch.randn(2), torch.randn(2, 2), torch.randn(5, 2, 2)
    f = torch.compile(lambda c, xs: scan(rnn_cell(w, b), c, xs), backend="inductor", fullgraph=True, dynamic=dynamic)
    out, codes = run_and_get_code(f, c0, xs)
    code = "\n".join(codes)
    subgraphs = [part for part in code.split("\ndef ")[1:] if part.startswith("scan_loop_")]
    # the body is inlined into its for loop (range(5) or range(s0)): no subgraph function at all
    assert subgraphs == [], "expected no subgraph function"
    assert "_step in range(" in code and "while " not in code
    assert "assert_size_stride(scan_loop_" not in code, code[-3000:]
    assert_trees_close(out, loop(w, b, c0, xs, False))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_unrolled_blocks_of_sizes_off_the_alignment(dtype):
    """unroll=2 concatenates a block's step values; inductor writes a step's carry straight into
    its slice of that buffer and then handed the slice's storage on for reuse by the block's new
    carry: a view into a live buffer, 15 elements in (3x5), which failed inductor's 16-byte
    alignment assert on the loop's output. Such views are never reused now."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5, 5, 5, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(5, 5, generator=gen, dtype=dtype, requires_grad=True)
    x = torch.randn(3, 5, generator=gen, dtype=dtype)

    def body(h, wb):
        return h + torch.tanh(torch.nn.functional.linear(h, *wb)), h.sum(-1)

    def step(run):
        c, ys = run(x, (w, b))
        return (c, ys), torch.autograd.grad(c.pow(2).sum() + ys.sum(), (w, b))

    def reference(h, wbs):
        ys = []
        for i in range(5):
            h, y = body(h, (wbs[0][i], wbs[1][i]))
            ys.append(y)
        return h, torch.stack(ys)

    compiled = torch.compile(lambda h, wb: scan(body, h, wb, unroll=2), backend="inductor")
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else {}
    assert_trees_close(step(compiled), step(reference), **tol)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("init", ["empty", "none", "untouched"])
def test_scans_with_one_output(init, dynamic):
    """A scan whose only output is one y: no carry (``init`` empty or None), or a carry that
    needs no gradient, whose backward is such a scan. Inductor's pattern matcher put the lowered
    loop in place of the scan node itself, and the scan's ``getitem(scan, 0)`` then indexed a
    tensor: a compile error. Values and the gradient of xs against the loop."""
    xs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    c0 = {"empty": (), "none": None, "untouched": torch.zeros(2)}[init]

    def body(c, x):
        return c, torch.sin(x) * 1.5

    def run(fn, xs):
        c, ys = fn(body, c0, xs)
        return c, ys, torch.autograd.grad(ys.pow(2).sum(), xs)

    compiled = torch.compile(lambda xs: run(scan, xs), backend="inductor", dynamic=dynamic, fullgraph=False)
    assert_trees_close(compiled(xs), run(reference_scan, xs), atol=1e-12, rtol=1e-10)
    if dynamic:  # the same compiled code at another length
        xs2 = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
        assert_trees_close(compiled(xs2), run(reference_scan, xs2), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("shape", [(), (3,)])
@pytest.mark.parametrize("case", ["same_tensor_twice", "zero_gradients_of_two_carries"])
def test_two_carries_starting_from_one_buffer(case, shape):
    """Two carries that start as one buffer: one tensor passed twice in init, or (in the backward)
    the gradients of two carries the loss does not read, both the same zero. Inductor copies the
    second carry; on torch 2.9 a 0-dim copy stayed unrealized and the loop failed to compile
    ("NotImplementedError: Pointwise"). Values and gradients against the loop."""
    torch.manual_seed(0)
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    s = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def body(c, x):
        a, s, t = c
        return (a * x, s * 1.5, t + 1.0), (a * s).sum() + t.sum()

    def run(fn, a, s, xs):
        init = (a, s, s) if case == "same_tensor_twice" else (a, s * 2, s * 3)
        (ca, cs, ct), ys = fn(body, init, xs)
        loss = ys.pow(2).sum() + (ca.sum() + cs.sum() + ct.sum() if case == "same_tensor_twice" else 0)
        return ca, ys, torch.autograd.grad(loss, (a, s, xs))

    compiled = torch.compile(lambda a, s, xs: run(scan, a, s, xs), backend="inductor")
    assert_trees_close(compiled(a, s, xs), run(reference_scan, a, s, xs), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_in_the_body_in_float64_and_float32(dtype):
    """A body calling CPU flash attention (its logsumexp saved for the backward). torch 2.9
    fakes a float64 attention's logsumexp as float32: the scan's stacked buffer for it was
    float32, generated code read float64 values as float32 and the backward failed ("expected
    scalar type Double but found Float"). Values and gradients against the loop."""
    torch.manual_seed(0)
    w = (torch.randn(8, 24, dtype=dtype) * 0.3).requires_grad_()
    h0 = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    xs = torch.randn(3, 2, 5, 8, dtype=dtype, requires_grad=True)

    def body(h, x):
        q, k, v = ((h + x) @ w).reshape(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = torch.tanh(h + a.transpose(1, 2).reshape(2, 5, 8))
        return h, h.sum(-1)

    def run(fn, w, h0, xs):
        h, ys = fn(body, h0, xs)
        return h, ys, torch.autograd.grad(h.pow(2).sum() + ys.pow(2).sum(), (w, h0, xs))

    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=1e-3, rtol=1e-4)
    compiled = torch.compile(lambda w, h0, xs: run(scan, w, h0, xs), backend="inductor")
    assert_trees_close(compiled(w, h0, xs), run(reference_scan, w, h0, xs), **tol)


def test_a_scan_in_an_inlined_scan_body():
    """The outer loop runs as a for loop around its inlined body, which holds the inner loop,
    a for loop too (``tests/inductor/test_inductor_nested.py``). Values of the eager loop."""
    w = torch.randn(4, 4, dtype=torch.float64)

    def outer(c, xs):
        c2, ys = scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c, xs)
        return c2 * 0.5, ys.sum(0)

    def f(c0, xss):
        return scan(outer, c0, xss)

    c0, xss = torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 5, 2, 4, dtype=torch.float64)
    got, codes = run_and_get_code(torch.compile(f, backend="inductor", fullgraph=True), c0, xss)
    want = f(c0, xss)
    assert_trees_close(got, want, atol=1e-10, rtol=1e-10)
    assert "_step in range(3):" in codes[0] and "_step in range(5):" in codes[0]
    assert "while should_loop:" not in codes[0]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gradients_through_a_scan_in_a_scan_body(backend):
    """A nested scan whose inner body reads a closure that requires grad: the
    compiled gradients of the closure and the init are the nested loops'."""
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)

    def inner(c, x):
        return torch.tanh(c @ w + x), c.sum(-1)

    def outer(c, xs):
        c2, ys = scan(inner, c, xs)
        return c2 * 0.5, ys.sum(0)

    def loss(scan_fn, c0, xss):
        c, ys = scan_fn(outer, c0, xss)
        return c.square().sum() + ys.sin().sum()

    c0 = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    xss = torch.randn(3, 5, 2, 4, dtype=torch.float64)
    got = torch.autograd.grad(torch.compile(lambda c0, xss: loss(scan, c0, xss), backend=backend)(c0, xss), (c0, w))
    want = torch.autograd.grad(loss(reference_scan, c0, xss), (c0, w))
    assert_trees_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("where", ["carry", "ys", "closure"])
def test_a_complex_scan_is_a_scan_error_naming_the_leaf(where):
    """Inductor's pattern passes skip nodes with complex values, so no pass lowered such a scan:
    upstream's then failed with a bare "scan is not lowered to while_loop"."""
    z = torch.randn(2, 3, dtype=torch.complex64)
    if where == "carry":
        init, fn, name = z, lambda c, x: (c * x, x), r"init leaf 0 is torch.complex64 of shape \(2, 3\)"
    elif where == "ys":
        init, fn, name = torch.randn(2, 3), lambda c, x: (c * x, torch.polar(c.abs(), x)), r"ys leaf 0 .* \(4, 2, 3\)"
    else:
        init, fn, name = torch.randn(2, 3), lambda c, x: (c * x + (z * x).real, c), "closed-over tensor 0"
    f = torch.compile(lambda init, xs: scan(fn, init, xs), backend="inductor", fullgraph=True)
    with pytest.raises(Exception, match=rf"inductor cannot compile a scan whose inputs or outputs are complex \({name}"):
        f(init, torch.randn(4, 2, 3))


@pytest.mark.parametrize("second", ["same", "view"])
def test_one_value_returned_as_two_carries(second):
    """``return (h, h), y``: inductor's while_loop refused carries that alias ("Output aliasing is
    currently not supported in compiled torch.while_loop"); the loop allows it."""
    def body(c, x):
        h = torch.tanh(c[0] * c[1] + x)
        return (h, h if second == "same" else h.view(3, 2).view(2, 3)), h.sum()

    def f(a, b, xs):
        return scan(body, (a, b), xs, reverse=True)

    def loss_and_grads(fn, a, b, xs):
        a, b, xs = (t.clone().requires_grad_() for t in (a, b, xs))
        (c0, c1), ys = fn(a, b, xs)
        return (c0, c1, ys), torch.autograd.grad((c0 * 2 + c1).sum() + ys.sum(), (a, b, xs))

    a, b, xs = torch.randn(2, 3), torch.randn(2, 3), torch.randn(5, 2, 3)
    want = loss_and_grads(lambda a, b, xs: reference_scan(body, (a, b), xs, reverse=True), a, b, xs)
    got = loss_and_grads(torch.compile(f, backend="inductor", fullgraph=True), a, b, xs)
    assert_trees_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_transposed_y_under_sqrt_remat():
    """``remat="sqrt"`` (two scans) with a transposed y: a backward loop's carry started from a
    transposed gradient that inductor realized contiguous while the body kept the transposed
    strides ("Expected carried_inputs and body_output to have same metadata")."""
    w = torch.randn(3, 3, requires_grad=True)

    def body(c, x):
        return torch.tanh(c @ w + x), c.t()

    def loss_and_grads(fn, init, xs):
        init, xs = init.clone().requires_grad_(), xs.clone().requires_grad_()
        c, ys = fn(init, xs)
        weights = torch.arange(ys.numel(), dtype=ys.dtype).reshape(ys.shape)
        return (c, ys), torch.autograd.grad(c.sum() + (ys * weights).sum(), (init, xs, w))

    init, xs = torch.randn(2, 3), torch.randn(5, 2, 3)
    want = loss_and_grads(lambda i, x: reference_scan(body, i, x), init, xs)
    f = torch.compile(lambda i, x: scan(body, i, x, remat="sqrt"), backend="inductor", fullgraph=True)
    assert_trees_close(loss_and_grads(f, init, xs), want, atol=1e-4, rtol=1e-5)
