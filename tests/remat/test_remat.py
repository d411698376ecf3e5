"""Remat policies (strings and RematPolicy objects, checkpoint_name, offload, sqrt) against the loop.

Every policy must give the loop's values and gradients in every mode; what it
changes is what a step keeps for the backward, checked here by what the
backward recomputes (FLOPs, saved graph values) and what the eager engine keeps.
"""
import os
import random
import subprocess
import sys

import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop
from torch_scan_hop import (
    RematPolicy,
    ScanError,
    checkpoint_name,
    dots_saveable,
    save_only_these_names,
    scan,
)

D = torch.float64


def _policies():
    return {
        "recompute_all": "recompute_all",
        "min_cut": "min_cut",
        "sqrt": "sqrt",
        "binomial": ("binomial", 2),
        "dots_saveable": dots_saveable,
        "names": save_only_these_names("a", "b"),
        "user": RematPolicy(lambda op, name: name == "a" or op is torch.ops.aten.sin.default),
        "offload": dots_saveable.with_offload("cpu"),
    }


POLICIES = list(_policies())


def random_body(seed, w, v):
    """A random step over a vocabulary of matmuls, pointwise ops, named values and x."""
    rng = random.Random(seed)
    ops = [rng.choice(["mm", "tanh", "sin", "mulx", "name_a", "name_b", "sigmoid", "mmv"]) for _ in range(6)]

    def body(c, x):
        h = c + x
        for op in ops:
            if op == "mm":
                h = h @ w
            elif op == "mmv":
                h = torch.tanh(h @ v) * h
            elif op == "mulx":
                h = h * x
            elif op.startswith("name"):
                h = checkpoint_name(torch.cos(h), op[-1])
            else:
                h = getattr(torch, op)(h)
        return torch.tanh(h), (h * h).sum(-1)

    return body


def loss_and_grads(run, inputs):
    carry, ys = run()
    loss = carry.sum() + ys.sum()
    return [loss, *torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)]


def _problem(seed, length=5):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 4, dtype=D, generator=g, requires_grad=True)
    v = (torch.randn(4, 4, dtype=D, generator=g) / 2).requires_grad_()
    init = torch.randn(3, 4, dtype=D, generator=g, requires_grad=True)
    xs = torch.randn(length, 3, 4, dtype=D, generator=g, requires_grad=True)
    return random_body(seed, w, v), init, xs, [init, xs, w, v]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_eager_random_bodies_match_the_loop(seed, policy, reverse):
    body, init, xs, inputs = _problem(seed)
    want = loss_and_grads(lambda: reference_scan(body, init, xs, reverse=reverse), inputs)
    got = loss_and_grads(lambda: scan(body, init, xs, reverse=reverse, remat=_policies()[policy]), inputs)
    assert_trees_close(got, want)


@pytest.mark.parametrize("policy", POLICIES)
def test_gradcheck_float64(policy):
    body, init, xs, _ = _problem(7, length=4)
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def f(init, xs, w):
        def step(c, x):
            c, y = body(c, x)
            return c @ w, y
        c, ys = scan(step, init, xs, remat=_policies()[policy])
        return c, ys

    assert torch.autograd.gradcheck(f, (init, xs, w))


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_masks_and_double_backward_match_the_loop(policy):
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    init, xs = torch.randn(2, 4, dtype=D), torch.randn(6, 2, 4, dtype=D)

    def body(c, x):
        h = torch.nn.functional.dropout(torch.sin(c @ w + x), 0.5)
        return checkpoint_name(h, "a"), h.sum()

    def run(scan_fn):
        torch.manual_seed(3)
        c, ys = scan_fn(body, init, xs)
        (g,) = torch.autograd.grad(c.sum() + ys.sum(), w, create_graph=True)
        return c, ys, g, torch.autograd.grad(g.sum(), w)[0]

    want = run(reference_scan)
    assert_trees_close(run(lambda *a: scan(*a, remat=_policies()[policy])), want)


@pytest.mark.parametrize("policy", ["recompute_all", "min_cut", "names", "dots_saveable", "user"])
def test_a_random_op_from_a_later_step_on_matches_the_loop(engines, policy):
    # recipes serve steps 0-2; step 3 draws a mask after a matmul and a named value: recompute_all and
    # policies re-run steps 3-5 from the RNG state step 3 started from (never noted per step while recipes
    # served), names handing back step 3's named value kept while recipes served; op-level policies kept
    # no op outputs in step 3 (its re-run computes them) and hand back those of steps 4-5
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), (torch.randn(6, 2, 4, dtype=D), torch.arange(6))

    def body(c, x):
        x, i = x
        h = checkpoint_name(torch.sin(c @ w + x), "a")
        if i.item() >= 3:
            h = torch.nn.functional.dropout(h, 0.5) + torch.rand_like(h)
        return torch.tanh(h), h.sum()

    def run(scan_fn):
        torch.manual_seed(3)
        torch.rand(5)  # the scan starts from a state that is not the seed's
        return loss_and_grads(lambda: scan_fn(body, init, xs), [init, w])

    want = run(reference_scan)
    assert_trees_close(run(lambda *a: scan(*a, remat=_policies().get(policy, policy))), want)
    (engine,) = engines
    assert engine.hot.usable == (policy == "min_cut")


def _backward_mm_flops(remat):
    from torch.utils.flop_counter import FlopCounterMode

    w = torch.randn(16, 16, requires_grad=True)
    c, _ = scan(lambda c, x: (torch.tanh(torch.tanh(c @ w) @ w + x), None), torch.randn(8, 16),
                 torch.randn(10, 8, 16), remat=remat)
    with FlopCounterMode(display=False) as counter:
        c.sum().backward()
    return counter.get_total_flops()


def test_eager_policies_recompute_what_they_do_not_save():
    plain = _backward_mm_flops("save_all")
    assert _backward_mm_flops(dots_saveable) == plain  # matmul outputs kept: only pointwise ops re-run
    rerun = 10 * 2 * (2 * 8 * 16 * 16)  # both forward matmuls of each of the 10 steps re-run
    # recompute_all from recipes: the second matmul only makes the next carry (kept): not re-run
    assert _backward_mm_flops("recompute_all") == plain + rerun // 2
    # min_cut keeps at most half of save_all's bytes, the carry counted: here only the carry
    assert _backward_mm_flops("min_cut") == plain + rerun // 2
    # names from recipes too: with nothing named, as recompute_all
    assert _backward_mm_flops(save_only_these_names("nothing named so")) == plain + rerun // 2


def test_named_values_are_what_save_only_these_names_keeps(engines):
    w = torch.randn(4, 4, requires_grad=True)

    def body(c, x):
        a = checkpoint_name(torch.sin(c @ w), "a")
        b = checkpoint_name(torch.cos(a), "b")
        return torch.tanh(b + x), None

    c, _ = scan(body, torch.randn(2, 4), torch.randn(5, 2, 4), remat=save_only_these_names("b"))
    (engine,) = engines
    assert [[k for k, *_ in kept] for kept in engine.kept] == [[("checkpoint_name", "b")]] * 5
    c.sum().backward()
    assert checkpoint_name(w, "a") is w  # outside a scan: the identity


def test_named_values_stop_the_recipes_that_read_them(engines):
    from torch.utils.flop_counter import FlopCounterMode

    w = torch.randn(16, 16, dtype=D, requires_grad=True)
    init, xs = torch.randn(8, 16, dtype=D, requires_grad=True), torch.randn(6, 8, 16, dtype=D, requires_grad=True)

    def body(c, x):
        h = c + x
        for k in range(4):
            h = checkpoint_name(torch.tanh(h @ w), f"layer{k}")
        return h, h.mean(-1)

    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, xs, w])
    flops = {}
    for remat in ("save_all", save_only_these_names("layer1", "layer3")):
        c, ys = scan(body, init, xs, remat=remat)
        with FlopCounterMode(display=False) as counter:
            got = loss_and_grads(lambda: (c, ys), [init, xs, w])
        assert_trees_close(got, want)
        flops[remat] = counter.get_total_flops()
    (engine,) = engines
    assert engine.hot.usable and [len(seeds) for seeds in engine.hot.seeds] == [2] * 6  # layer1, layer3 (the carry)
    # layer1 kept: the backward recomputes layer0 from c + x and layer2 from layer1, no re-run of the body
    assert flops[save_only_these_names("layer1", "layer3")] == flops["save_all"] + 6 * 2 * (2 * 8 * 16 * 16)


def test_sqrt_keeps_about_sqrt_length_carries(engines):
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    body = lambda c, x: (torch.tanh(c @ w + x), c.sum())  # noqa: E731
    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(100, 2, 4, dtype=D)
    got = loss_and_grads(lambda: scan(body, init, xs, remat="sqrt"), [init, w])
    (engine,) = engines
    assert engine.block == 10 and sorted(engine.carries) == list(range(0, 100, 10))
    assert engine.cached == {}  # every re-run value was handed out to the backward
    assert_trees_close(got, loss_and_grads(lambda: reference_scan(body, init, xs), [init, w]))


@pytest.mark.parametrize("length,slots", [(100, 4), (100, 10), (37, 1), (1, 1), (5, 8)])
def test_binomial_keeps_at_most_k_carries_for_the_revolve_cost(engines, monkeypatch, length, slots):
    from math import comb

    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    calls = []

    def body(c, x):
        calls.append(1)
        return torch.tanh(c @ w + x), c.sum()

    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(length, 2, 4, dtype=D)
    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, w])
    calls.clear()
    c, ys = scan(body, init, xs, remat=("binomial", slots))
    (engine,) = engines
    most, rerun = [len(engine.carries)], engine._rerun
    monkeypatch.setattr(engine, "_rerun", lambda pos, carry: (most.append(len(engine.carries)), rerun(pos, carry))[1])
    loss = c.sum() + ys.sum()
    got = [loss, *torch.autograd.grad(loss, [init, w])]
    assert_trees_close(got, want)
    assert max(most) == min(slots, length)
    sweeps = next(r for r in range(length + 1) if comb(slots + r, slots) >= length)
    assert len(calls) <= length * (sweeps + 2)  # the forward, r sweeps, the re-run on the tape


def _mlp_step(w, layers=4):
    def body(c, x):
        h = c + x
        for _ in range(layers):
            h = torch.tanh(h @ w)
        return h, h.mean(-1)
    return body


def test_min_cut_keeps_half_of_save_all_for_the_least_recompute(engines):
    from torch.utils.flop_counter import FlopCounterMode

    w = torch.randn(16, 16, dtype=D, requires_grad=True)
    init, xs = torch.randn(8, 16, dtype=D, requires_grad=True), torch.randn(6, 8, 16, dtype=D, requires_grad=True)
    body = _mlp_step(w)
    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, xs, w])

    def backward_flops(remat):
        c, ys = scan(body, init, xs, remat=remat)
        with FlopCounterMode(display=False) as counter:
            got = loss_and_grads(lambda: (c, ys), [init, xs, w])
        assert_trees_close(got, want)
        return counter.get_total_flops()

    plain, flops = backward_flops("save_all"), backward_flops("min_cut")
    # save_all keeps c + x and the 4 layers' outputs (the last the next carry): min_cut the carry and
    # one layer's output, the backward re-runs 2 of the 4 matmuls (recompute_all 3, the last makes the carry)
    (engine,) = engines
    assert [len(seeds) for seeds in engine.hot.seeds] == [2] * 6
    assert flops == plain + 6 * 2 * (2 * 8 * 16 * 16)
    assert backward_flops("recompute_all") == plain + 6 * 3 * (2 * 8 * 16 * 16)


def test_min_cut_keeps_values_it_cannot_recompute(engines):
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(6, 2, 4, dtype=D, requires_grad=True)
    masks = []

    def body(c, x):
        h = torch.sin(c + x) @ w
        mask = torch.rand_like(h) > 0.5  # random: kept as it is, and what is computed from it
        masks.append(mask)
        return torch.tanh(h * mask), h.sum(-1)

    torch.manual_seed(0)
    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, xs, w])
    torch.manual_seed(0)
    got = loss_and_grads(lambda: scan(body, init, xs, remat="min_cut"), [init, xs, w])
    assert_trees_close(got, want)
    (engine,) = engines
    assert engine.hot.usable and [len(r) for r in engine.hot.recipes] == [4] * 6  # add, sin, matmul, sum


def test_min_cut_with_in_place_ops_matches_the_loop_or_says_why():
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), torch.randn(5, 2, 4, dtype=D, requires_grad=True)

    def body(c, x):
        h = c + x
        h.mul_(2)  # its recipe (c + x) would be stale: h is kept as it is
        z = torch.sin(h) @ w
        z.add_(1)  # in place on a hot value: still hot
        return torch.tanh(z), (h * z).sum()

    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, xs, w])
    assert_trees_close(loss_and_grads(lambda: scan(body, init, xs, remat="min_cut"), [init, xs, w]), want)

    buf = torch.ones(2, 4, dtype=D)
    c, _ = scan(lambda c, x: (torch.sin(c * buf) @ w, None), init, xs, remat="min_cut")
    buf.add_(1)  # read by a recipe (c * buf): recomputing now would give other values
    with pytest.raises(ScanError, match="modified by an in-place operation"):
        c.sum().backward()


@pytest.mark.parametrize("policy", POLICIES)
def test_values_modified_in_place_inside_the_body_match_the_loop(policy):
    # sigmoid_ saves its result: the value after the write, which its recipe (the matmul) is not; a
    # named or matmul value kept, then modified in place after tanh read it: the kept alias changed
    # too (the re-run computes it again); a random op from step 2 on: recipes stop, steps re-run
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def body(c, x):
        x, i = x
        y = c @ w
        y.sigmoid_()
        a = checkpoint_name(torch.sin(y @ w), "a")
        z = torch.tanh(a)
        a.mul_(2)
        if i.item() >= 2:
            z = z + torch.nn.functional.dropout(a, 0.5)
        return z + a + x, (y * a).sum()

    init, xs = torch.randn(2, 4, dtype=D, requires_grad=True), (torch.randn(5, 2, 4, dtype=D), torch.arange(5))

    def run(scan_fn):
        torch.manual_seed(0)
        return loss_and_grads(lambda: scan_fn(body, init, xs), [init, w])

    assert_trees_close(run(lambda *a: scan(*a, remat=_policies()[policy])), run(reference_scan))


def _body_halving_its_carry(w):
    def body(c, x):  # the carry is a step's matmul output, which nothing saved: the loop allows the write
        x, i = x
        if i.item() > 0:
            c.mul_(0.5)
        y = torch.sin(c) @ w
        return y + x, torch.exp(y).sum()
    return body


@pytest.mark.parametrize("policy", POLICIES)
def test_a_body_modifying_its_carry_in_place_matches_the_loop(policy):
    # a re-run started from the kept carry, which the forward's write had halved, and as a fresh
    # leaf (a raw "leaf Variable ... in-place" error); now each step's kept carry is its own copy
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    init = torch.randn(2, 4, dtype=D, requires_grad=True)
    xs = (torch.randn(5, 2, 4, dtype=D), torch.arange(5))
    body = _body_halving_its_carry(w)
    assert_trees_close(loss_and_grads(lambda: scan(body, init, xs, remat=_policies()[policy]), [init, w]),
                       loss_and_grads(lambda: reference_scan(body, init, xs), [init, w]))


def test_an_error_inside_the_backward_leaves_the_process_able_to_exit():
    # An error raised while the backward unpacks a value (here: the kept carry found written, with the
    # forward's restore turned off) left exp's node in the engine's queue, and the interpreter died at
    # exit (SIGSEGV) before drain.drain_at_exit. A child raises it under every policy and exits.
    code = ("import torch, test_remat as t\n"
            "from torch_scan_hop.remat import replay\n"
            "replay.StepReplay._restore_kept_carry = lambda self, pos: None\n"
            "for policy in t.POLICIES:\n"
            "    try:\n"
            "        t.test_a_body_modifying_its_carry_in_place_matches_the_loop(policy)\n"
            "    except t.ScanError as e:\n"
            "        assert 'modified its carry in place at step' in str(e), e\n"
            "        print('raised')\n"
            "print('end')\n")
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=here,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([here, *sys.path])))
    assert out.returncode == 0 and out.stdout.endswith("end\n"), (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.count("raised") >= 3, out.stdout  # recompute_all, sqrt, binomial re-run steps at least


@pytest.mark.parametrize("policy", ["recompute_all", "min_cut", "names", "dots_saveable", "user"])
def test_a_kept_value_modified_in_place_is_an_error_as_in_the_loop(policy):
    # the new carry is kept, not recomputed: modified after the scan, the loop's tape refuses it
    w = torch.randn(4, 4, dtype=D, requires_grad=True)

    def body(c, x):
        return checkpoint_name(torch.tanh(c @ w + x), "a"), c.sum()

    init, xs = torch.randn(2, 4, dtype=D), torch.randn(5, 2, 4, dtype=D)
    for scan_fn, error in ((reference_scan, RuntimeError), (lambda *a: scan(*a, remat=_policies()[policy]), ScanError)):
        c, _ = scan_fn(body, init, xs)
        with torch.no_grad():
            c.mul_(2)
        with pytest.raises(error, match="modified by an in-?place operation"):
            c.sum().backward()


def test_offload_moves_saved_values_and_back(engines, monkeypatch):
    moves = []
    real_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        moves.append(args[0] if args else kwargs.get("device"))
        return real_to(t, *args, **kwargs)

    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    body = lambda c, x: (torch.tanh(c @ w + x), None)  # noqa: E731
    init, xs = torch.randn(2, 4, dtype=D), torch.randn(3, 2, 4, dtype=D)
    c, _ = scan(body, init, xs, remat=dots_saveable.with_offload("cpu"))
    monkeypatch.setattr(torch.Tensor, "to", to)
    (g,) = torch.autograd.grad(c.sum(), w)
    monkeypatch.undo()
    assert moves == [torch.device("cpu")] * 3  # each step's kept matmul goes back to its device
    (engine,) = engines
    assert all(v.device.type == "cpu" for kept in engine.kept for _, v, _ in kept)
    torch.testing.assert_close(g, torch.autograd.grad(reference_scan(body, init, xs)[0].sum(), w)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to host memory needs a CUDA device")
def test_offload_from_cuda_keeps_saved_values_in_host_memory(engines):
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    body = lambda c, x: (torch.tanh(c @ w + x), None)  # noqa: E731
    init, xs = torch.randn(8, 64, device="cuda"), torch.randn(6, 8, 64, device="cuda")
    c, _ = scan(body, init, xs, remat=dots_saveable.with_offload("cpu"))
    (engine,) = engines
    assert all(v.device.type == "cpu" for kept in engine.kept for _, v, _ in kept) and engine.kept[0]
    (g,) = torch.autograd.grad(c.sum(), w)
    torch.testing.assert_close(g, torch.autograd.grad(reference_scan(body, init, xs)[0].sum(), w)[0])


def test_bad_policies_are_scan_errors():
    init, xs = torch.zeros(2), torch.zeros(3, 2)
    with pytest.raises(ScanError, match="remat='everything' is not a policy"):
        scan(lambda c, x: (c, x), init, xs, remat="everything")
    with pytest.raises(ScanError, match="one or more str names"):
        save_only_these_names()
    with pytest.raises(ScanError, match="name must be a str"):
        checkpoint_name(init, 3)
    with pytest.raises(ScanError, match="save must be a function"):
        RematPolicy("mm")


def test_a_body_that_runs_other_ops_when_re_run_is_a_scan_error():
    w = torch.randn(3, requires_grad=True)
    calls = []

    def body(c, x):
        calls.append(1)
        c = torch.nn.functional.dropout(c, 0.0)  # not recorded as a recipe: recompute_all re-runs the body
        return (c * w if len(calls) <= 4 else torch.sin(c) * w * w), None

    c, _ = scan(body, torch.ones(3), torch.zeros(4, 3), remat="recompute_all")
    with pytest.raises(ScanError, match="must run the same ops when it is re-run"):
        c.sum().backward()


# ---------------------------------------------------------------- traced paths


def _mm_count(gm):
    return sum(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in gm.graph.nodes)


def test_traced_policies_partition_the_step_as_they_say():
    w = torch.randn(8, 8)

    def cell(c, x):
        a = checkpoint_name(c @ w, "a")
        b = checkpoint_name(torch.sin(a) @ w, "b")
        return torch.tanh(b + x), a.sum()

    c, x = torch.randn(2, 8), torch.randn(2, 8)
    mms = {name: _mm_count(torch_scan_hop.fwd_bwd(cell, c, x, remat=r).bwd)
           for name, r in [("save_all", "save_all"), ("dots", dots_saveable), ("none", "recompute_all"),
                           ("a", save_only_these_names("a")), ("ab", save_only_these_names("a", "b"))]}
    plain = mms["save_all"]
    assert (mms["dots"], mms["ab"], mms["a"], mms["none"]) == (plain, plain, plain + 1, plain + 2)
    fb = torch_scan_hop.fwd_bwd(cell, c, x, remat=save_only_these_names("a"))
    assert not any(n.target is torch.ops.torch_scan_hop.named_value.default
                   for g in (fb.fwd, fb.bwd) for n in g.graph.nodes)


def _traced_problem():
    body, init, xs, inputs = _problem(11)
    return body, init, xs, inputs


@pytest.mark.parametrize("policy", ["dots_saveable", "names", "user", "sqrt"])
def test_make_fx_matches_the_loop(policy):
    from torch.fx.experimental.proxy_tensor import make_fx

    body, init, xs, inputs = _traced_problem()
    w, v = inputs[2], inputs[3]

    def f(init, xs, w, v):
        c, ys = scan(body, init, xs, remat=_policies()[policy])
        return c.sum() + ys.sum()

    def grads(init, xs, w, v):
        return torch.autograd.grad(f(init, xs, w, v), [init, xs])

    gm = make_fx(grads)(init, xs, w, v)
    want = loss_and_grads(lambda: reference_scan(body, init, xs), [init, xs])[1:]
    assert_trees_close(list(gm(init, xs, w, v)), want)


@pytest.mark.parametrize("policy", ["dots_saveable", "names", "user", "sqrt"])
def test_torch_compile_matches_the_loop(policy):
    torch._dynamo.reset()
    body, init, xs, inputs = _traced_problem()
    remat = _policies()[policy]

    def f(init, xs):  # save_only_these_names may also be called in it (a constant to Dynamo)
        return scan(body, init, xs, remat=save_only_these_names("a", "b") if policy == "names" else remat)

    got = loss_and_grads(lambda: torch.compile(f, backend="aot_eager", fullgraph=True)(init, xs), inputs)
    assert_trees_close(got, loss_and_grads(lambda: reference_scan(body, init, xs), inputs))


def test_another_policy_object_compiles_again():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    w = torch.randn(4, 4, requires_grad=True)

    def body(c, x):
        return checkpoint_name(torch.tanh(c @ w + x), "a"), None

    # read from a dict: torch 2.15's Dynamo installed no guard on such an object (an argument it did)
    held = {"policy": save_only_these_names("a")}
    f = torch.compile(lambda c, xs: scan(body, c, xs, remat=held["policy"])[0], backend=backend, fullgraph=True)
    init, xs = torch.randn(2, 4), torch.randn(3, 2, 4)
    f(init, xs)
    f(init, xs)
    assert len(graphs) == 1
    held["policy"] = RematPolicy(lambda op, name: False, label="other")
    f(init, xs)  # was (2.15): the first graph again, with the first policy's token
    assert len(graphs) == 2

    def tokens(gm):
        return [n.kwargs.get("remat") for n in gm.graph.nodes if n.op == "call_function" and "remat" in n.kwargs]

    assert tokens(graphs[0]) != tokens(graphs[1])


def test_a_policy_object_built_while_compiling_is_a_clear_error():
    torch._dynamo.reset()

    def f(init, xs):
        return scan(lambda c, x: (torch.sin(c + x), None), init, xs, remat=RematPolicy(lambda op, name: False))

    with pytest.raises(ScanError, match="build it outside"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(3), torch.zeros(4, 3))


def test_offload_on_a_traced_path_is_a_scan_error():
    from torch.fx.experimental.proxy_tensor import make_fx

    w = torch.randn(3, requires_grad=True)

    def f(init, xs):
        c, _ = scan(lambda c, x: (torch.sin(c * w + x), None), init, xs, remat=dots_saveable.with_offload())
        return torch.autograd.grad(c.sum(), w)

    with pytest.raises(ScanError, match="implemented for eager scans only"):
        make_fx(f)(torch.ones(3), torch.zeros(4, 3))


def test_export_keeps_named_values_out_of_the_way():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, h, xs):
            return scan(lambda c, x: (checkpoint_name(torch.tanh(self.lin(c) + x), "a"), c.sum()), h, xs,
                        remat=save_only_these_names("a"))

    m, h, xs = M(), torch.randn(2, 4), torch.randn(5, 2, 4)
    ep = torch.export.export(m, (h, xs))
    want = reference_scan(lambda c, x: (torch.tanh(m.lin(c) + x), c.sum()), h, xs)
    assert_trees_close(ep.module()(h, xs), want)


def test_xla_grads_match_the_loop():
    pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra")
    import torch_xla.core.xla_model as xm

    dev = xm.xla_device()
    body, init, xs, inputs = _problem(5)
    w, v = inputs[2], inputs[3]
    want = loss_and_grads(lambda: reference_scan(body, init, xs), inputs)
    wx, vx = w.detach().to(dev).requires_grad_(), v.detach().to(dev).requires_grad_()
    ix, xx = init.detach().to(dev).requires_grad_(), xs.detach().to(dev).requires_grad_()
    body_x = random_body(5, wx, vx)
    for policy in (save_only_these_names("a", "b"), dots_saveable, "sqrt"):
        got = loss_and_grads(lambda policy=policy: scan(body_x, ix, xx, remat=policy), [ix, xx, wx, vx])
        assert_trees_close([t.cpu() for t in got], want)


def test_scan_layers_takes_policies_and_refuses_unknown_ones():
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    h = torch.randn(2, 4, requires_grad=True)

    def grads(out):
        return torch.autograd.grad(out.sum(), [h, *layers.parameters()])

    want_h = h
    for layer in layers:
        want_h = layer(want_h)
    want = grads(want_h)
    for remat in ("recompute_all", "sqrt", dots_saveable, save_only_these_names("a")):
        assert_trees_close(grads(torch_scan_hop.scan_layers(layers, h, remat=remat)), want)
    with pytest.raises(ScanError, match="is not a policy"):
        torch_scan_hop.scan_layers(layers, h, remat="everything")


# ---------------------------------------------------------------- compiled memory (issue 39, item 6)


def _named_mlp(device, width, depth=4):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth)).to(device)

    def body(c, x):
        h = c + x
        for k, lin in enumerate(layers):
            h = checkpoint_name(torch.tanh(lin(h)), f"layer{k}")
        return h, h.mean(-1)

    return body


def test_traced_steps_save_each_value_once():
    from torch_scan_hop import fwd_bwd

    body = _named_mlp("cpu", 8)
    for remat in ("save_all", "min_cut", save_only_these_names("layer1", "layer3")):
        fb = fwd_bwd(body, torch.zeros(2, 8), torch.randn(2, 8), remat=remat)
        (outs,) = fb.fwd.graph.find_nodes(op="output")[0].args
        saved = outs[2:]
        assert len(saved) == len(set(saved)), (remat, saved)  # a duplicate is one more (T, ...) buffer


def _cpu_peak(fn):
    """Peak bytes allocated while fn runs, from the profiler's allocation record (what
    benchmarks/backward.py reads); the compiled loop's buffer pool is emptied first, so that
    the storage it hands out is allocated inside the window."""
    import gc
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch_scan_hop.empty_cache()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.remove(path)
    start = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - start


def _peaks(device, peak, width, batch, length, policies=("save_all", "recompute_all", "min_cut"), depth=4):
    body = _named_mlp(device, width, depth)
    c0, xs = torch.zeros(batch, width, device=device), torch.randn(length, batch, width, device=device)

    def run(remat):
        c, ys = scan(body, c0, xs, remat=remat)
        (c.sum() + ys.sum()).backward()

    compiled = torch.compile(run)
    out = {}
    for remat in policies:
        compiled(remat)  # compile outside the measured window
        out[remat] = (peak(lambda remat=remat: run(remat)), peak(lambda remat=remat: compiled(remat)))
    return out


def test_compiled_peaks_stay_near_eager_ones_on_cpu():
    # activations dominate (batch 256, width 64), as in the benchmark; min_cut saves what save_all
    # does on this body (test_traced_steps_save_each_value_once covers its duplicates)
    peaks = _peaks("cpu", _cpu_peak, 64, 256, 24, ("save_all", "recompute_all"))
    eager_save_all = peaks["save_all"][0]
    assert peaks["save_all"][1] <= 1.15 * eager_save_all  # 1.66x before saved values were deduplicated
    # recompute_all: carries plus one step, and the backward's gradient accumulators
    assert peaks["recompute_all"][1] <= 0.5 * eager_save_all
    assert peaks["recompute_all"][1] <= 1.5 * peaks["recompute_all"][0]


_SQRT_SUMS = ("traced sqrt's backward keeps three sets of weight-gradient sums, each started from zeros and added "
              "after: the tail scan's, the outer scan's and each block's inner scan's (eager: one); folding a "
              "sum's add into the next loop's initial value is not built")


@pytest.mark.parametrize("remat", ["save_all", "recompute_all", "min_cut", "sqrt"])
def test_compiled_peaks_no_worse_than_eager_on_cpu(remat):
    """Weights dominate (width 1024, batch 8): the backward loop's weight-gradient sums. Compiled,
    each step's new sum had a new buffer while the old one and the loop's zeros stayed alive (two
    sets more than eager); ``inductor.codegen.carry_in_place`` writes them into the carry's own.
    sqrt: not met (``_SQRT_SUMS``): ~2.0x eager alone in a process, at most eager's in some runs of
    the whole suite (torch 2.15; the allocator's state before the step), so the bound is the gap's."""
    ((eager, compiled),) = _peaks("cpu", _cpu_peak, 1024, 8, 8, (remat,), depth=2).values()
    bound = 2.2 if remat == "sqrt" else 1.05
    assert compiled <= bound * eager, (remat, eager / 2 ** 20, compiled / 2 ** 20, _SQRT_SUMS if remat == "sqrt" else "")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA peaks (torch.cuda.max_memory_allocated) need a GPU")
@pytest.mark.xfail(strict=True, reason=(
    "not met for recompute_all (expected; not re-measured on a GPU since the fix): the H200 (torch 2.11, "
    "benchmarks/cuda.py --parts peaks) measured eager 20.5 MiB against compiled 81. The backward loop's "
    "weight-gradient sums now accumulate in their own buffers (inductor.codegen.carry_in_place), which "
    "took ~51 MiB off each compiled peak on the CPU at these sizes (benchmarks/carry_peaks.py --batch 64 "
    "--length 128: save_all 210.8 -> 160.0, recompute_all 83.3 -> 32.0, min_cut 210.8 -> 160.0 MiB); the "
    "H200's 81 less that is ~30 MiB, above 1.1 x eager's 20.5 there."))
def test_compiled_peaks_no_worse_than_eager_on_cuda():
    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peaks = _peaks("cuda", peak, 1024, 64, 128)  # the body and sizes
    for remat, (eager, compiled) in peaks.items():
        # eager min_cut keeps at most half of save_all's bytes (remat/keep.py); compiled min_cut is
        # functorch's partitioner, which never recomputes a matmul: no more than save_all there
        bound = peaks["save_all"][0] if remat == "min_cut" else eager
        assert compiled <= 1.1 * bound, (remat, peaks)


@pytest.mark.parametrize("seed", range(20))
def test_min_cut_gains_are_what_keeping_a_value_saves(seed):
    from torch_scan_hop.remat import keep, recipes as cheap

    rng = random.Random(seed)
    n = rng.randint(1, 30)
    recipes = [(None, tuple(cheap._Ref(p, 0) for p in rng.sample(range(r), min(r, rng.randint(0, 3)))), {})
               for r in range(n)]
    inputs = [keep.parents(r[1], set()) for r in recipes]
    costs = [rng.randint(0, 9) for _ in range(n)]
    needed, kept = set(rng.sample(range(n), rng.randint(1, n))), set(rng.sample(range(n), rng.randint(0, n // 3)))

    def cost(kept):  # by brute force: every recipe the needed ones reach, stopping at kept ones
        seen, todo = set(), [r for r in needed if r not in kept]
        while todo:
            r = todo.pop()
            if r not in seen:
                seen.add(r)
                todo.extend(p for p in inputs[r] if p not in kept)
        return sum(costs[r] for r in seen)

    gains = keep._gains(needed, kept, inputs, costs)
    for rid in range(n):
        assert gains.get(rid, 0) == cost(kept) - cost(kept | {rid}), rid
