"""Random scan programs run by ``jax.lax.scan`` and by ours: the same final carry, the same ys
(stacked in input order also when ``reverse=True``), the same gradients of init, xs and closures.

The other differential tests check ours against the Python loop; this one checks the conventions
the loop cannot pin down, against the scan users port from: how ys stack under ``reverse``, what
``length=0`` returns (ys with a leading 0, shaped as one step would make them), ``xs=None`` with
``length``, pytrees of carries and ys (tuples, dicts, ``None`` ys), ``unroll``. A program is drawn
once as data and interpreted twice, with torch and with jax.numpy, so both sides run the same
arithmetic. float64 on both sides (jax's x64 mode is switched on for these tests only).
"""
import os
import random

import pytest
import torch

from torch_scan_hop import scan

# the reference runs on the CPU: a jax built for CUDA otherwise takes 75% of the GPU's memory at
# its first array (60 GB on an H100, which starved every other test process of the machine)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax = pytest.importorskip("jax", reason="jax is the `test` extra's (Python >= 3.11); without it there is no reference")
jnp = pytest.importorskip("jax.numpy")

SHAPES = [(), (3,), (2, 3)]
ACTS = ["tanh", "sin", "sigmoid", "scale"]


class Ops:
    """The few functions the interpreter needs, named once per library."""

    def __init__(self, lib):
        self.lib = lib

    def act(self, name, v):
        if name == "scale":
            return 0.9 * v
        if self.lib == "torch":
            return getattr(torch, name)(v)
        return jax.nn.sigmoid(v) if name == "sigmoid" else getattr(jnp, name)(v)

    def total(self, v):
        return v.sum()

    def broadcast(self, v, shape):
        return (torch if self.lib == "torch" else jnp).broadcast_to(v, shape)


def draw(seed):
    """A program as plain data: the carry and xs trees' leaf shapes, the terms of each new carry
    leaf, the ys tree, the length and options."""
    rng = random.Random(seed)
    n_carry, n_xs = rng.randint(1, 3), rng.randint(0, 3)
    carry_shapes = [rng.choice(SHAPES) for _ in range(n_carry)]
    xs_shapes = [rng.choice(SHAPES) for _ in range(n_xs)]
    sources = [("c", k) for k in range(n_carry)] + [("x", j) for j in range(n_xs)] + [("w",), ("s",)]
    terms = [[(rng.choice(sources), rng.uniform(-0.8, 0.8)) for _ in range(rng.randint(1, 3))]
             for _ in range(n_carry)]
    acts = [rng.choice(ACTS) for _ in range(n_carry)]
    ys = rng.choice(["none", "tuple", "dict", "leaf", "empty"])
    ys_from = [rng.randrange(n_carry + n_xs + 1) for _ in range(rng.randint(1, 2))]
    return {"carry": carry_shapes, "xs": xs_shapes, "terms": terms, "acts": acts, "ys": ys,
            "ys_from": ys_from, "length": rng.choice([0, 1, 2, 5]), "reverse": rng.random() < 0.5,
            "unroll": rng.choice([None, 1, 2, 3]), "carry_tree": rng.choice(["tuple", "dict", "nested"]),
            "xs_none": n_xs == 0 and rng.random() < 0.7, "seed": seed,
            "pass_length": n_xs == 0 or rng.random() < 0.3}


def as_tree(kind, leaves):
    if kind == "tuple":
        return tuple(leaves)
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(leaves)}
    return (leaves[0], {"rest": list(leaves[1:])})


def tree_leaves(kind, tree):
    if kind == "tuple":
        return list(tree)
    if kind == "dict":
        return [tree[f"k{i}"] for i in range(len(tree))]
    return [tree[0], *tree[1]["rest"]]


def term_value(ops, source, carry, x, w, s, shape):
    """One source as a value of the carry leaf's shape: itself when the shapes agree, a matmul
    with the closed-over ``w`` for a trailing 3, else its sum broadcast."""
    kind = source[0]
    if kind == "w":
        return ops.broadcast(ops.total(w), shape)
    if kind == "s":
        return ops.broadcast(s, shape)
    v = carry[source[1]] if kind == "c" else x[source[1]]
    if tuple(v.shape) == shape:
        return v if not shape or shape[-1] != 3 else v @ w
    return ops.broadcast(ops.total(v), shape)


def make_body(prog, ops):
    def body(carry_tree, x_tree, w, s):
        carry = tree_leaves(prog["carry_tree"], carry_tree)
        x = [] if x_tree is None else list(x_tree)
        new = []
        for shape, terms, act in zip(prog["carry"], prog["terms"], prog["acts"]):
            acc = 0.5 * carry[len(new)]
            for source, coef in terms:
                acc = acc + coef * term_value(ops, source, carry, x, w, s, shape)
            new.append(ops.act(act, acc))
        picks = [(new + x + [s])[i] for i in prog["ys_from"]]
        picks = [p * 1.5 for p in picks]
        ys = {"none": None, "tuple": tuple(picks), "dict": {"a": picks[0], "b": (picks[-1],)},
              "leaf": picks[0], "empty": ()}[prog["ys"]]
        return as_tree(prog["carry_tree"], new), ys
    return body


def inputs(prog):
    g = torch.Generator().manual_seed(prog["seed"])
    T = prog["length"]
    init = [torch.randn(sh, generator=g, dtype=torch.float64) for sh in prog["carry"]]
    xs = [torch.randn((T, *sh), generator=g, dtype=torch.float64) for sh in prog["xs"]]
    w = torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.5
    s = torch.randn((), generator=g, dtype=torch.float64)
    return init, xs, w, s


def flat(tree):
    """The tensors of a tree (torch's pytree counts ``None`` as a leaf, jax's as an empty node)."""
    return [leaf for leaf in torch.utils._pytree.tree_leaves(tree) if leaf is not None]


def loss_weights(outs, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def scan_fn(prog, lib):
    """The program as a function of (init leaves, xs leaves, w, s) -> (final carry, ys), run by
    our scan (``lib="torch"``) or by ``jax.lax.scan`` (``"jax"``)."""
    body = make_body(prog, Ops(lib))
    run = scan if lib == "torch" else (lambda *a, unroll=None, **k: jax.lax.scan(*a, unroll=unroll or 1, **k))

    def f(init, xs, w, s):
        xs_arg = None if prog["xs_none"] else tuple(xs)
        return run(lambda c, x: body(c, x, w, s), as_tree(prog["carry_tree"], list(init)), xs_arg,
                   length=prog["length"] if prog["pass_length"] else None, reverse=prog["reverse"],
                   unroll=prog["unroll"])
    return f


def run_ours(prog, mode):
    init, xs, w, s = (t.requires_grad_() if isinstance(t, torch.Tensor) else [v.requires_grad_() for v in t]
                      for t in inputs(prog))
    f = scan_fn(prog, "torch")
    if mode != "eager":
        torch._dynamo.reset()
        f = torch.compile(f, backend=mode, fullgraph=True)
    final, ys = f(init, xs, w, s)
    outs = [*flat(final), *flat(ys)]
    weights = loss_weights(outs, prog["seed"])
    loss = sum((o * wt).sum() for o, wt in zip(outs, weights))
    wrt = [*init, *xs, w, s]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return final, ys, [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]


def run_jax(prog):
    f = scan_fn(prog, "jax")
    args = to_jax(inputs(prog))
    shapes = jax.tree_util.tree_leaves(jax.eval_shape(f, *args))
    weights = [jnp.asarray(t.numpy()) for t in loss_weights([torch.empty(o.shape) for o in shapes], prog["seed"])]

    def loss(*args):
        out = f(*args)
        return sum((o * wt).sum() for o, wt in zip(jax.tree_util.tree_leaves(out), weights)), out

    (g_init, g_xs, g_w, g_s), (final, ys) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    return final, ys, [*g_init, *g_xs, g_w, g_s]


def to_jax(tree):
    return jax.tree_util.tree_map(lambda t: jnp.asarray(t.detach().numpy()), tree)


@pytest.fixture(autouse=True)
def x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def assert_same(prog, what, got, want):
    got_leaves, want_leaves = flat(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), f"{what}: {len(got_leaves)} tensors vs jax {len(want_leaves)} ({prog})"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        b = torch.from_numpy(jax.device_get(b).copy())
        assert tuple(a.shape) == tuple(b.shape), f"{what} leaf {i}: shape {tuple(a.shape)} vs jax {tuple(b.shape)} ({prog})"
        torch.testing.assert_close(a.detach(), b, rtol=1e-7, atol=1e-9, msg=lambda m: f"{what} leaf {i}: {m} ({prog})")


def same_tree_kinds(got, want):
    """The container types agree level by level (tuple, dict keys, None ys), not only the leaves."""
    if want is None or isinstance(want, (tuple, list)) and not want:
        return got is None or isinstance(got, (tuple, list)) and not got
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_tree_kinds(got[k], want[k]) for k in want)
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(same_tree_kinds, got, want))
    return isinstance(got, torch.Tensor)


def check(seed, mode):
    prog = draw(seed)
    want = run_jax(prog)
    got = run_ours(prog, mode)
    for what, g, w in zip(["final carry", "ys", "gradients"], got, want):
        if what != "gradients":
            assert same_tree_kinds(g, w), f"{what}: {g!r} vs jax {w!r} ({prog})"
        assert_same(prog, what, g, w)


@pytest.mark.parametrize("seed", range(40))
def test_eager_matches_jax(seed):
    check(seed, "eager")


@pytest.mark.parametrize("seed", range(100, 108))
def test_compiled_matches_jax(seed):
    check(seed, "aot_eager")


@pytest.mark.parametrize("seed", range(200, 202))
def test_inductor_matches_jax(seed):
    check(seed, "inductor")



@pytest.mark.parametrize("seed", range(300, 310))
def test_jvp_matches_jax(seed):
    """Forward mode (``torch.func.jvp``) against ``jax.jvp``, tangents for every input."""
    prog = draw(seed)
    primals = inputs(prog)
    g = torch.Generator().manual_seed(seed + 2)
    tangents = torch.utils._pytree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), primals)
    f, f_jax = scan_fn(prog, "torch"), scan_fn(prog, "jax")  # flattened: torch.func.jvp takes no None outputs
    out, tan = torch.func.jvp(lambda *a: tuple(flat(f(*a))), tuple(primals), tuple(tangents))
    want_out, want_tan = jax.jvp(lambda *a: tuple(jax.tree_util.tree_leaves(f_jax(*a))),
                                 tuple(to_jax(primals)), tuple(to_jax(tangents)))
    assert_same(prog, "jvp primal", out, want_out)
    assert_same(prog, "jvp tangent", tan, want_tan)


@pytest.mark.parametrize("seed", range(400, 410))
def test_vmap_matches_jax(seed):
    """``torch.func.vmap`` over a batch of inits and xs against ``jax.vmap`` (the closures shared)."""
    prog = draw(seed)
    g = torch.Generator().manual_seed(seed + 3)
    init, xs, w, s = inputs(prog)
    init = [torch.randn((2, *t.shape), generator=g, dtype=t.dtype) for t in init]
    xs = [torch.randn((2, *t.shape), generator=g, dtype=t.dtype) for t in xs]
    f, f_jax = scan_fn(prog, "torch"), scan_fn(prog, "jax")  # flattened: torch.func.vmap takes no None outputs
    got = torch.func.vmap(lambda *a: tuple(flat(f(*a))), in_dims=(0, 0, None, None))(init, xs, w, s)
    want = jax.vmap(lambda *a: tuple(jax.tree_util.tree_leaves(f_jax(*a))),
                    in_axes=(0, 0, None, None))(*to_jax((init, xs, w, s)))
    assert_same(prog, "vmap", got, want)
