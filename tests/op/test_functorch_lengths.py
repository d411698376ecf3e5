"""torch.func transforms of scans of length 0 and 1 (and 3), against the Python loop (float64).

At length 0 the loop never calls fn and returns init; its ys are built here by hand (a 0 in front of
one step's y shape, y's dtype), while scan learns them from a fake run of fn. That fake run once
met the transforms' wrapped tensors (jvp's primals are views) and failed; every transform and
composition below is compared with the same transform of the loop, values and derivatives, with
pytree carries and ys (an int leaf, a None leaf), a bare tensor carry, ``xs=None`` with ``length``,
``reverse``, ``dim=1`` and no ys at all.
"""
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import assert_trees_close, reference_scan
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import scan

D = torch.float64
VARIANTS = ["tree", "tensor", "xs_none", "reverse", "dim1", "no_ys"]


def make_body(w, variant):
    def body(c, x):
        if variant == "tensor":  # bare tensors: scan's fast path
            h = torch.tanh(c @ w + x * c.sum())
            return h, (h * x).sum(-1)
        u = c["h"].cos() if x is None else x["u"]
        h = torch.tanh(c["h"] @ w + u * c["h"].sum())
        ys = None if variant == "no_ys" else {"s": (h * u).sum(-1), "k": c["k"], "n": None}
        return {"h": h, "k": c["k"] + 1}, ys
    return body


def empty_ys(variant):
    """The ys of a zero-length loop, by hand: one step's y is {"s": (2,) float64, "k": () int64, "n": None}."""
    if variant == "no_ys":
        return None
    if variant == "tensor":
        return torch.empty(0, 2, dtype=D)
    return {"s": torch.empty(0, 2, dtype=D), "k": torch.empty(0, dtype=torch.int64), "n": None}


def loop(fn, init, xs=None, *, length=None, variant=None, **kw):
    carry, ys = reference_scan(fn, init, xs, length=length, **kw)
    n = length if xs is None else pytree.tree_leaves(xs)[0].shape[kw.get("dim", 0)]
    return carry, (empty_ys(variant) if n == 0 else ys)


def ours(fn, init, xs=None, *, variant=None, **kw):
    return scan(fn, init, xs, **kw)


def function(run, variant, n, full=False):
    """f(w, h, u) -> the float outputs (final h, ys["s"]) of a scan of length n run by ``run``;
    ``full``: the whole (carry, ys) pytree."""
    if full == "tensors":  # every tensor leaf (int ones too): what vmap can return
        return lambda *a: [t for t in pytree.tree_leaves(function(run, variant, n, True)(*a)) if t is not None]
    kw = dict(reverse=variant == "reverse", dim=1 if variant == "dim1" else 0)

    def f(w, h, u):
        body = make_body(w, variant)
        if variant == "tensor":
            out = run(body, h, u, variant=variant)
            return out if full else tuple(out)
        init = {"h": h, "k": torch.zeros((), dtype=torch.int64)}
        if variant == "xs_none":
            c, ys = run(body, init, None, length=n, variant=variant)
        else:
            c, ys = run(body, init, {"u": u.movedim(0, kw["dim"])}, variant=variant, **kw)
        return (c, ys) if full else (c["h"],) + (() if ys is None else (ys["s"],))
    return f


def args(n):
    g = torch.Generator().manual_seed(n)
    return (torch.randn(3, 3, dtype=D, generator=g) * 0.5, torch.randn(2, 3, dtype=D, generator=g),
            torch.randn(n, 2, 3, dtype=D, generator=g))


def scalar(f):
    return lambda *a: sum((o.sin() * (i + 1)).sum() for i, o in enumerate(f(*a)))


def batch(t):
    return torch.stack([t, 2 * t - 0.5])


TRANSFORMS = {
    "grad": lambda f, a: grad(scalar(f), argnums=(0, 1, 2))(*a),
    "vjp": lambda f, a: (lambda out, pull: (out, pull(tuple(o.cos() for o in out))))(*vjp(f, *a)),
    "jvp": lambda f, a: jvp(f, a, tuple(t.sin() for t in a)),
    "jacfwd": lambda f, a: jacfwd(f, argnums=1)(*a),
    "jacrev": lambda f, a: jacrev(f, argnums=1)(*a),
    "hessian": lambda f, a: hessian(scalar(f), argnums=1)(*a),
    "vmap": lambda f, a: vmap(f, in_dims=(None, 0, 1))(a[0], batch(a[1]), batch(a[2]).movedim(0, 1)),
    "jvp_of_vmap": lambda f, a: jvp(lambda h: vmap(f, in_dims=(None, 0, None))(a[0], h, a[2]),
                                    (batch(a[1]),), (batch(a[1]).cos(),)),
    "vmap_of_jvp": lambda f, a: vmap(lambda h, u: jvp(lambda h: f(a[0], h, u), (h,), (h.cos(),)))(
        batch(a[1]), batch(a[2])),
    "vmap_of_grad": lambda f, a: vmap(grad(scalar(f), argnums=(0, 1, 2)), in_dims=(None, 0, None))(
        a[0], batch(a[1]), a[2]),
    "grad_of_vmap": lambda f, a: grad(lambda w: vmap(scalar(f), in_dims=(None, 0, None))(w, batch(a[1]), a[2]).sum())(
        a[0]),
    "jacfwd_of_jacrev": lambda f, a: jacfwd(jacrev(scalar(f), argnums=1), argnums=1)(*a),
}


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transform_matches_the_same_transform_of_the_loop(transform, variant, n):
    a = args(n)
    got = TRANSFORMS[transform](function(ours, variant, n), a)
    assert_trees_close(got, TRANSFORMS[transform](function(loop, variant, n), a))


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("variant", VARIANTS)
def test_vmap_gives_every_leaf_of_the_loop_over_the_batch(variant, n):
    """Every leaf (the int ones too): the empty ys get the batch dim in front; unbatched, the
    whole pytree (None leaves too) is the loop's."""
    w, h, u = args(n)
    assert_trees_close(function(ours, variant, n, full=True)(w, h, u), function(loop, variant, n, full=True)(w, h, u))
    got = vmap(function(ours, variant, n, full="tensors"), in_dims=(None, 0, None))(w, batch(h), u)
    per_sample = [function(loop, variant, n, full="tensors")(w, hb, u) for hb in batch(h)]
    assert_trees_close(got, [torch.stack(leaves) for leaves in zip(*per_sample)])


@pytest.mark.parametrize("variant", ["tree", "tensor", "xs_none", "no_ys"])
def test_jvp_of_an_empty_scan_is_the_init_tangent_and_empty_ys(variant):
    """As jax.jvp of a length-0 lax.scan: the final carry's tangent is init's, the ys' are empty."""
    w, h, u = args(0)
    th = torch.randn_like(h)
    (carry, *ys), (t_carry, *t_ys) = jvp(lambda h: function(ours, variant, 0)(w, h, u), (h,), (th,))
    assert torch.equal(carry, h) and torch.equal(t_carry, th)
    assert [(y.shape, y.dtype) for y in (*ys, *t_ys)] == [((0, 2), D)] * 2 * (variant != "no_ys")
    with torch.autograd.forward_ad.dual_level():  # the same through dual tensors
        dual = torch.autograd.forward_ad.make_dual(h, th)
        carry, *ys = function(ours, variant, 0)(w, dual, u)
        assert torch.equal(torch.autograd.forward_ad.unpack_dual(carry).tangent, th)


TRACED = ["grad", "vjp", "jvp", "jacfwd", "hessian", "vmap", "vmap_of_grad", "jvp_of_vmap"]


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("variant", ["tree", "xs_none"])
@pytest.mark.parametrize("transform", TRACED)
def test_transforms_traced_by_make_fx(transform, variant, n):
    """make_fx of the transformed function, the graph run again on the same inputs.
    (jacrev of a function with several outputs is left out: make_fx of torch's own basis
    construction reads a tensor's value, with the loop as well.)"""
    a = args(n)
    gm = make_fx(lambda *a: TRANSFORMS[transform](function(ours, variant, n), a))(*a)
    assert_trees_close(gm(*a), TRANSFORMS[transform](function(loop, variant, n), a))


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("transform", ["grad", "jvp", "jacfwd", "vmap_of_grad"])
def test_transforms_under_torch_compile(transform, n, fresh_dynamo):
    a = args(n)
    compiled = torch.compile(lambda *a: TRANSFORMS[transform](function(ours, "tree", n), a),
                             backend="aot_eager", fullgraph=True)
    assert_trees_close(compiled(*a), TRANSFORMS[transform](function(loop, "tree", n), a))


NORM_TRANSFORMS = ["jvp", "jacfwd", "vmap_of_jvp", "jacrev", "dual_level"]


@pytest.mark.parametrize("n", [0, 1])
@pytest.mark.parametrize("transform", NORM_TRANSFORMS)
def test_layer_norm_with_a_differentiated_weight_and_a_constant_bias(transform, n):
    """A body with a LayerNorm whose weight is differentiated and whose bias is not. At length 0
    the fake run of fn met torch's jvp formula, which adds the bias's ZeroTensor tangent through
    meta copies, next to the fakes: "Unhandled FakeTensor Device Propagation ... meta, cpu"
    (fuzz seed 5010). That run now has forward AD off; values and tangents as the loop's."""
    g = torch.Generator().manual_seed(n)
    bias, h, u = (torch.randn(3, dtype=D, generator=g), torch.randn(2, 3, dtype=D, generator=g),
                  torch.randn(n, 2, 3, dtype=D, generator=g))

    def f(run):
        def g(w):
            def body(c, x):
                y = torch.nn.functional.layer_norm(c + x, (3,), w, bias, eps=1e-3)
                return torch.nn.functional.layer_norm(y, (3,), bias, w, eps=1e-3), y.sum(-1)
            return run(body, h, u)
        return g

    def apply(run, w):
        if transform == "jvp":
            return jvp(f(run), (w,), (w.cos(),))
        if transform == "jacfwd":
            return jacfwd(f(run))(w)
        if transform == "jacrev":
            return jacrev(f(run))(w)
        if transform == "vmap_of_jvp":
            return vmap(lambda w: jvp(f(run), (w,), (w.cos(),)))(batch(w))
        with torch.autograd.forward_ad.dual_level():
            out = f(run)(torch.autograd.forward_ad.make_dual(w, w.cos()))
            return [tuple(torch.autograd.forward_ad.unpack_dual(o)) for o in out]

    w = torch.randn(3, dtype=D, generator=g)
    got = apply(lambda fn, h, u: scan(fn, h, u), w)
    want = apply(lambda fn, h, u: loop(fn, h, u, variant="tensor"), w)
    assert_trees_close(got, want)


def _in_place_body(w):
    def body(c, x):
        a = torch.tanh(c + x)  # batched where c or x is
        b = a.clone().mul_(a @ w)  # in place into a: fine where a is batched (or w is not)
        return b, b.sum(-1) * x[0, 0]
    return body


def _loop_in_place(h, w, xs):
    """The loop; at length 0 (no step) init and the empty ys of one step's y, (0, 2)."""
    if xs.shape[0] == 0:
        return h, torch.empty(0, 2, dtype=D)
    return reference_scan(_in_place_body(w), h, xs)


VMAPS = {  # how (h, w, xs) are batched: B=2 samples of each, xs batched behind the scan dim or in front
    "carry_and_weight": lambda f, h, w, xs: vmap(f, in_dims=(0, 0, None))(h.expand(2, 2, 3), w, xs),
    "xs_at_dim_1": lambda f, h, w, xs: vmap(f, in_dims=(None, 0, 1))(h, w, xs.unsqueeze(1).expand(-1, 2, 2, 3)),
    "nested_xs_at_dims_2_and_0": lambda f, h, w, xs: vmap(vmap(f, in_dims=(None, None, 0)), in_dims=(0, 0, 2))(
        h.expand(2, 2, 3), w, xs.unsqueeze(0).unsqueeze(3).expand(3, -1, 2, 2, 3).contiguous()),
}


@pytest.mark.parametrize("n", [0, 1, 3])
@pytest.mark.parametrize("batching", list(VMAPS))
def test_vmap_with_the_body_writing_in_place_into_a_batched_carry_value(batching, n):
    """The length-0 shape run stood an unbatched tensor in for a batched carry: the body's
    ``a`` came out unbatched, and its in-place multiply by a batched ``a @ w`` raised vmap's
    in-place error, which the loop never raises (at length 0 it runs no step). The stand-ins
    of batched carries and x slices are batched as the loop's values are, also at a batch
    dim behind the scan dim and under nested vmaps."""
    torch.manual_seed(0)
    h, xs = torch.randn(2, 3, dtype=D), torch.randn(n, 2, 3, dtype=D)
    w = torch.randn(2, 3, 3, dtype=D) * 0.5
    got = VMAPS[batching](lambda h, w, xs: scan(_in_place_body(w), h, xs), h, w, xs)
    assert_trees_close(got, VMAPS[batching](_loop_in_place, h, w, xs))


AFTER_A_FAILED_CAPTURE = r"""
import gc, sys
import torch
from torch.func import hessian, jacfwd, jacrev, vmap
from torch.utils._pytree import tree_leaves
from torch_scan_hop import scan

D = torch.float64
torch.manual_seed(0)
w = torch.randn(3, 3, dtype=D)

def body(c, x):
    h = torch.tanh(c["a"] @ w + x)
    return {"a": h, "b": c["b"] * 1.5}, (h.sum(), {"z": h * 2})

def loop(c, xs):
    ys = []
    for x in xs:
        c, y = body(c, x)
        ys.append(y)
    return c, (torch.stack([y[0] for y in ys]), {"z": torch.stack([y[1]["z"] for y in ys])})

def flat(fn):
    return lambda a, b, xs: tuple(tree_leaves(fn({"a": a, "b": b}, xs)))

f = lambda c, xs: scan(body, c, xs)
a, b, xs = torch.randn(3, dtype=D), torch.randn(2, dtype=D), torch.randn(int(sys.argv[1]), 3, dtype=D)
total = lambda fn: lambda *args: sum(t.sum() for t in fn(*args))
torch.compile(hessian(total(flat(f)), argnums=(0, 2)), backend="aot_eager")(a, b, xs)
exclude = torch._C._dispatch_tls_local_exclude_set()
try:  # torch's own bug may refuse this capture (the compiled loop fails alike): either way is fine
    torch.compile(vmap(jacfwd(flat(f), argnums=0), in_dims=(0, None, None)), backend="aot_eager")(
        torch.randn(2, 3, dtype=D), b, xs)
except Exception as e:
    print("capture failed:", type(e).__name__)
gc.collect()
assert torch._C._dispatch_tls_local_exclude_set() == exclude, torch._C._dispatch_tls_local_exclude_set()
later = [(lambda fn: hessian(total(fn), argnums=(0, 2)), (a, b, xs)),
         (lambda fn: vmap(jacrev(fn), in_dims=(0, None, None)), (torch.randn(2, 3, dtype=D), b, xs))]
for transform, args in later:
    torch.testing.assert_close(transform(flat(f))(*args), transform(flat(loop))(*args))
print("ok")
"""


def test_transforms_after_a_failed_compiled_capture_under_vmap_of_jacfwd():
    """A body that Dynamo fails to run on fake tensors under ``vmap(jacfwd(...))`` (torch's own
    ``_fw_primal`` internal assert on dual tensors; the compiled loop fails alike) left
    functorch's and autograd's dispatch keys excluded for the rest of the process, once the
    garbage collector freed the failed trace (``op.compile_errors.tensor_repr_releases_its_guard``:
    torch's tensor repr keeps its guard alive in a traceback). Every later transform failed ("Cannot access storage of
    TensorWrapper"). Length 1: the capture that left it (torch 2.15). Run in a process of its
    own: the failure it guards against outlives the test that causes it."""
    out = subprocess.run([sys.executable, "-c", AFTER_A_FAILED_CAPTURE, "1"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-3000:] + out.stderr[-6000:]


def _writes_batched_rows(K, w):
    """buf[t] = row and K[t] = row with rows batched by ``w`` into an unbatched carried buffer and an
    unbatched closed-over ``K``, read at the step index (``select``): vmap refuses such a write where
    the loop makes it, but at length 0 the loop never calls fn."""
    def body(state, x, t):
        h, buf = state
        r = buf.select(0, t) * 1.5 + K.select(0, t)
        K[t] = h @ w
        buf[t] = torch.tanh(h @ w)
        return (h, buf), (r @ w).sum(-1)
    return body


@pytest.mark.parametrize("remat", ["save_all", "partition_fn"])
def test_vmap_of_an_empty_scan_writing_batched_rows_into_unbatched_buffers(remat):
    """The ys' shape run refused the writes (retried unbatched, the batched closure still refused)
    or read the fake step index (the op's vmap rule, reached with a partition function as remat):
    now the write goes to a batched copy of the buffer, as the shape run's own."""
    from torch._functorch.partitioners import default_partition
    h, w = torch.randn(2, 3, dtype=D), torch.randn(2, 3, 3, dtype=D)
    K = torch.randn(4, 2, 3, dtype=D)
    kw = {"remat": default_partition} if remat == "partition_fn" else {}

    def f(w):
        return scan(_writes_batched_rows(K, w), (h, torch.zeros(4, 2, 3, dtype=D)), None, length=0,
                    with_index=True, **kw)
    before = K.clone()
    (h_out, buf_out), ys = vmap(f)(w)
    assert tuple(ys.shape) == (2, 0, 2)
    assert_trees_close((h_out, buf_out, K), (h.expand(2, 2, 3), torch.zeros(2, 4, 2, 3, dtype=D), before))


def _late_batched(K):
    def body(carry, x, t):
        a, b = carry
        if K is not None:
            K[t] = a  # a: unbatched at step 0, batched from step 1 on (a + x), like the loop's
        return (a + x, b * 0.5 + a.sum()), (a * b).sum(-1)  # b batched from step 2 on
    return body


@pytest.mark.parametrize("n,reverse", [(1, False), (4, True)])
def test_vmap_batches_the_carries_step_by_step_as_the_loop(n, reverse):
    """The op's vmap rule (reached with a partition function as remat) batched a carry from step 0
    where the loop's becomes batched at step 1: at length 1 its write into an unbatched closed-over
    buffer was refused (vmap's RuntimeError) where the loop's was not. The steps before the carries'
    fixed point run alone, batched as the loop's, the rest as one scan: length 4, reverse (two steps
    alone, then a scan of two), without the write (the loop's is refused at step 1, as ours)."""
    from torch._functorch.partitioners import default_partition
    a, b, xs = torch.randn(2, 3, dtype=D), torch.randn(2, 3, dtype=D), torch.randn(2, n, 2, 3, dtype=D)

    def loop(body, init, xs):
        carry, ys = init, [None] * xs.shape[0]
        for i in (range(xs.shape[0] - 1, -1, -1) if reverse else range(xs.shape[0])):
            carry, ys[i] = body(carry, xs[i], torch.tensor(i))
        return carry, torch.stack(ys)

    def ours(body, init, xs):
        return scan(body, init, xs, with_index=True, reverse=reverse, remat=default_partition)

    K1, K2 = (torch.zeros(4, 2, 3, dtype=D), torch.zeros(4, 2, 3, dtype=D)) if n == 1 else (None, None)
    got = vmap(lambda xs: ours(_late_batched(K1), (a, b), xs))(xs)
    assert_trees_close((got, K1), (vmap(lambda xs: loop(_late_batched(K2), (a, b), xs))(xs), K2))
