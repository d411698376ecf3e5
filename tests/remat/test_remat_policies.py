"""Op-level remat policies (``dots_saveable``, a user's ``RematPolicy``) in eager: by recipes, against the loop.

Such a policy keeps the outputs of the calls that run an op it saves and recomputes the rest of
what the backward reads from the step's recorded recipes, as ``save_only_these_names`` does; the
body is never re-run while recipes serve (remat/recipes.py, remat/policy_ops.py). Checked here: the
loop's values and gradients on random problems (pytrees, closures used several times, lengths 0
and 1, reverse, dim), in eager and traced; what a step keeps; what the backward recomputes.
"""
import dataclasses

import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import RematPolicy, checkpoint_name, dots_saveable, save_only_these_names, scan

D = torch.float64
ADDMM_OR_SIN = RematPolicy(lambda op, name: op in (torch.ops.aten.addmm.default, torch.ops.aten.sin.default),
                           label="addmm_or_sin")


def _mlp(layers=4, hidden=16, dtype=D):
    torch.manual_seed(0)
    mlp = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, dtype=dtype) for _ in range(layers))

    def body(c, x):
        h = c + x
        for k, lin in enumerate(mlp):
            h = checkpoint_name(torch.tanh(lin(h)), f"layer{k}")
        return h, h.mean(-1)
    return mlp, body


def _grads_and_backward_flops(body, init, xs, params, remat):
    from torch.utils.flop_counter import FlopCounterMode

    c, ys = (reference_scan(body, init, xs) if remat is None else scan(body, init, xs, remat=remat))
    loss = c.sum() + ys.sum()
    with FlopCounterMode(display=False) as counter:
        grads = torch.autograd.grad(loss, [init, xs, *params])
    return [loss, *grads], counter.get_total_flops()


@pytest.mark.parametrize("policy", [dots_saveable, ADDMM_OR_SIN])
def test_op_policies_keep_the_matmuls_and_recompute_the_rest_from_recipes(engines, policy):
    mlp, body = _mlp()
    init = torch.randn(8, 16, dtype=D, requires_grad=True)
    xs = torch.randn(5, 8, 16, dtype=D, requires_grad=True)
    params = list(mlp.parameters())
    want, plain = _grads_and_backward_flops(body, init, xs, params, None)
    got, flops = _grads_and_backward_flops(body, init, xs, params, policy)
    assert_trees_close(got, want)
    assert flops == plain  # no matmul recomputed: only c + x and the tanhs
    (engine,) = engines
    assert engine.hot.usable and not any(engine.kept)  # recipes served every step: nothing to re-run
    # per step: layers 0-2's linear outputs (the tanhs the backward reads are recomputed from them) and
    # the new carry; layer 3's linear output is not kept: the backward reads only its tanh, the carry
    assert [len(seeds) for seeds in engine.hot.seeds] == [4] * 5


def test_a_saved_op_the_backward_does_not_read_is_not_kept(engines):
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def body(c, x):  # x @ w is kept only if the backward reads it: the add's backward reads nothing
        return torch.sin(c) + x @ w, None

    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(3, 2, 4, dtype=D)
    want = torch.autograd.grad(reference_scan(body, init, xs)[0].sum(), [init, w])
    assert_trees_close(torch.autograd.grad(scan(body, init, xs, remat=dots_saveable)[0].sum(), [init, w]), want)
    (engine,) = engines
    assert [list(seeds) for seeds in engine.hot.seeds] == [[2]] * 3  # the carry (the add's output) only


def test_what_a_call_runs_is_decided_per_argument_kind(engines):
    # torch.matmul of a matrix is an mm (dots_saveable keeps it), of a vector an mv (not a dot op)
    w, v = torch.randn(4, 4, dtype=D, requires_grad=True), torch.randn(4, dtype=D, requires_grad=True)

    def body(c, x):
        a = torch.matmul(torch.cos(c), w)
        b = torch.matmul(torch.cos(c + x), v)
        return torch.tanh(a * b.unsqueeze(-1)), None

    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(3, 2, 4, dtype=D)
    want = torch.autograd.grad(reference_scan(body, init, xs)[0].sum(), [init, w, v])
    assert_trees_close(torch.autograd.grad(scan(body, init, xs, remat=dots_saveable)[0].sum(), [init, w, v]), want)
    (engine,) = engines
    recipes = engine.hot.recipes[0]
    kept = sorted(getattr(recipes[rid][0], "__name__", "") for rid in engine.hot.seeds[0])
    assert kept == ["matmul", "tanh"]  # the mm's output and the carry; the mv's output is recomputed


def test_a_policy_reading_ops_and_names_keeps_both():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    policy = RematPolicy(lambda op, name: name == "a" or op is torch.ops.aten.mm.default)

    def body(c, x):
        a = checkpoint_name(torch.sin(c * x), "a")
        return torch.tanh(torch.cos(a) @ w), (a * a).sum()

    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(4, 2, 4, dtype=D, requires_grad=True)
    for reverse in (False, True):
        want = reference_scan(body, init, xs, reverse=reverse)
        got = scan(body, init, xs, reverse=reverse, remat=policy)
        assert_trees_close(got, want)
        assert_trees_close(torch.autograd.grad(got[0].sum() + got[1].sum(), [init, xs, w]),
                           torch.autograd.grad(want[0].sum() + want[1].sum(), [init, xs, w]))


@pytest.mark.parametrize("length", [0, 1, 3])
@pytest.mark.parametrize("policy", [dots_saveable, ADDMM_OR_SIN])
def test_gradcheck_on_pytrees_and_shared_closures(policy, length):
    lin = torch.nn.Linear(3, 3, dtype=D)
    w = torch.randn(3, 3, dtype=D, requires_grad=True)

    def f(h, s, xs_a, xs_b, w):
        def body(carry, x):
            h, s = carry["h"], carry["s"]
            h = torch.tanh(lin(h @ w) + x[0]) @ w  # the closure w used twice, the module's weight once
            s = s + torch.sin(h).sum(-1) * x[1]
            return {"h": h, "s": s}, (h.mean(), None)
        return scan(body, {"h": h, "s": s}, (xs_a, xs_b), remat=policy)

    args = (torch.randn(2, 3, dtype=D, requires_grad=True), torch.randn(2, dtype=D, requires_grad=True),
            torch.randn(length, 2, 3, dtype=D, requires_grad=True), torch.randn(length, 2, dtype=D, requires_grad=True),
            w)
    assert torch.autograd.gradcheck(lambda *a: [t for t in _leaves(f(*a)) if t is not None], args)


def _leaves(tree):
    import torch.utils._pytree as pytree
    return pytree.tree_flatten(tree)[0]


POLICIES = {"dots_saveable": dots_saveable, "addmm_or_sin": ADDMM_OR_SIN,
            "names": save_only_these_names("layer0")}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("seed", range(16))
def test_random_problems_match_the_loop_in_eager(seed, policy):
    # the differential fuzzer's problems (pytrees of float/int/bool leaves, closures used 0-3 times,
    # modules, lengths 0-9, reverse, dim) with this policy
    from _fuzz import generate
    from test_differential import expected, run_eager

    p = dataclasses.replace(generate(seed), remat=POLICIES[policy])
    run_eager(p, "eager", *expected(p))


@pytest.mark.parametrize("mode", ["make_fx_real", "make_fx_symbolic", "compile_aot_eager"])
@pytest.mark.parametrize("policy", ["dots_saveable", "addmm_or_sin"])
@pytest.mark.parametrize("seed", range(2))
def test_random_problems_match_the_loop_traced(seed, policy, mode):
    from _fuzz import generate
    from test_differential import expected, run_compile, run_make_fx

    p = dataclasses.replace(generate(seed), remat=POLICIES[policy])
    (run_compile if mode.startswith("compile") else run_make_fx)(p, mode, *expected(p))


@pytest.mark.parametrize("policy", ["dots_saveable", "addmm_or_sin"])
def test_inductor_and_export_match_the_loop(policy):
    torch._dynamo.reset()
    mlp, body = _mlp(layers=2, hidden=8, dtype=torch.float32)
    init = torch.randn(4, 8, requires_grad=True)
    xs = torch.randn(5, 4, 8, requires_grad=True)
    params = [init, xs, *mlp.parameters()]
    remat = POLICIES[policy]

    def run(scan_fn):
        c, ys = scan_fn(init, xs)
        return [c, ys, *torch.autograd.grad(c.sum() + (ys * ys).sum(), params)]

    want = run(lambda i, x: reference_scan(body, i, x))
    compiled = torch.compile(lambda i, x: scan(body, i, x, remat=remat), backend="inductor", fullgraph=True)
    assert_trees_close(run(compiled), want, rtol=1e-4, atol=1e-5)

    class M(torch.nn.Module):
        def forward(self, h, xs):
            return scan(body, h, xs, remat=remat)

    ep = torch.export.export(M(), (init.detach(), xs.detach()))
    assert_trees_close(list(ep.module()(init.detach(), xs.detach())), want[:2], rtol=1e-5, atol=1e-6)
