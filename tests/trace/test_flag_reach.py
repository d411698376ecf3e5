"""The loop's requires-grad flags read off one joint trace (trace/flag_reach.py, trace/joint.py).

A first training call traces the joint with every floating carry requiring grad and reads the
flags of every other carry-flag state the loop passes through off its autograd graph, instead
of tracing the body once per state. Each case compares, with the plain Python loop, the values,
the gradients (float64) of every input that requires grad, and every output's requires_grad
after that many steps; and counts the body traces (not timed): one where the flags could be
read off, more where the body reads flags or holds a custom autograd.Function.
"""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan
from torch_scan_hop.trace import cache, joint

D = torch.float64


@pytest.fixture
def traces(monkeypatch):
    """Body traces made for the flags: "joint" (a joint) and "flags" (a flags-only trace)."""
    seen = []
    real_flags, real_joint = joint._outputs_require_grad, joint.trace_joint
    monkeypatch.setattr(joint, "_outputs_require_grad", lambda *a, **k: seen.append("flags") or real_flags(*a, **k))
    monkeypatch.setattr(joint, "trace_joint", lambda *a, **k: seen.append("joint") or real_joint(*a, **k))
    cache.clear()
    yield seen
    cache.clear()


def _partition_fn():  # a partition function: plain eager then takes the traced path (a plan)
    from functorch.compile import default_partition

    return default_partition


class Flip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return -t

    @staticmethod
    def backward(ctx, g):
        return -g


# name -> (init factory, xs factory, body(w, b) -> fn(c, x), body traces for the flags)
CASES = {
    # a fresh carry the weight reaches in one step: one joint, its flags read off
    "fresh_carry": (lambda: (torch.zeros(2, 3, dtype=D),),
                    lambda: torch.randn(4, 2, 3, dtype=D),
                    lambda w, b: lambda c, x: ((torch.tanh(c[0] @ w + x + b),), c[0].sum(-1)),
                    ["joint"]),
    # init requires grad: the joint at init's state, no flags trace
    "init_requires_grad": (lambda: (torch.ones(2, 3, dtype=D, requires_grad=True),),
                           lambda: torch.randn(4, 2, 3, dtype=D),
                           lambda w, b: lambda c, x: ((torch.sin(c[0] * b) @ w + x,), c[0].sum()),
                           ["joint"]),
    # an integer counter beside the float carry: never differentiable
    "int_carry": (lambda: (torch.zeros(2, 3, dtype=D), torch.tensor(0)),
                  lambda: torch.randn(4, 2, 3, dtype=D),
                  lambda w, b: lambda c, x: ((torch.tanh(c[0] @ w + x * c[1]), c[1] + 1), c[0].sum()),
                  ["joint"]),
    # a float carry nothing requiring grad reaches: the fixed point is short of the guess
    "no_grad_float_carry": (lambda: (torch.zeros(2, 3, dtype=D), torch.zeros((), dtype=D)),
                            lambda: torch.randn(4, 2, 3, dtype=D),
                            lambda w, b: lambda c, x: ((torch.tanh(c[0] @ w + x) * c[1], c[1] + 1.0), c[1] * 2),
                            ["joint", "joint"]),
    # carry 1 reached only through carry 0: differentiable from the second step on
    "later": (lambda: (torch.zeros(3, dtype=D), torch.zeros(3, dtype=D)),
              lambda: torch.randn(4, 3, dtype=D),
              lambda w, b: lambda c, x: ((c[0] @ w + x, c[1] + c[0] * b), c[1].sum()),
              ["joint"]),
    # init requires grad and the body overwrites the carry: it stops requiring grad
    "overwritten": (lambda: (torch.ones(3, dtype=D, requires_grad=True),),
                    lambda: torch.randn(4, 3, dtype=D),
                    lambda w, b: lambda c, x: ((x * b,), c[0].sum() * 2),
                    ["joint"]),
    # swapped carries: the flags alternate step by step
    "swapped": (lambda: (torch.ones(3, dtype=D, requires_grad=True), torch.ones(3, dtype=D)),
                lambda: torch.randn(4, 3, dtype=D),
                lambda w, b: lambda c, x: ((c[1] * 1.5 + x, torch.sin(c[0]) @ w), c[1].sum()),
                ["joint"]),
    # detach and no_grad cut the weight's path: y never requires grad
    "detached": (lambda: (torch.zeros(3, dtype=D),),
                 lambda: torch.randn(4, 3, dtype=D),
                 lambda w, b: lambda c, x: ((c[0].detach() @ w + x,), _no_grad_sum(c[0] * 2)),
                 ["joint"]),
    # a body reading its carry's flag (its values the same either way: the body is traced
    # once, at the fixed point): flags traced as before, per state
    "reads_flag": (lambda: (torch.zeros(3, dtype=D),),
                   lambda: torch.randn(4, 3, dtype=D),
                   lambda w, b: lambda c, x: ((_same_either_way(c[0]) @ w + x,), c[0].sum()),
                   ["joint", "flags"]),
    # a custom autograd.Function: its forward could read ctx.needs_input_grad
    "custom_function": (lambda: (torch.zeros(3, dtype=D),),
                        lambda: torch.randn(4, 3, dtype=D),
                        lambda w, b: lambda c, x: ((Flip.apply(c[0]) @ w + x,), c[0].sum()),
                        ["joint", "flags"]),
}


def _same_either_way(t):
    return t * 1.0 if t.requires_grad else t.clone()


def _no_grad_sum(t):
    with torch.no_grad():
        return t.sum()


def _inputs(name, w_grad, b_grad):
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(sorted(CASES).index(name))
        make_init, make_xs, make_body, _ = CASES[name]
        w = torch.randn(3, 3, dtype=D).requires_grad_(w_grad)
        b = torch.randn(3, dtype=D).requires_grad_(b_grad)
        return make_init(), make_xs(), make_body(w, b), [w, b]


def _run(scan_fn, name, w_grad, b_grad, length):
    init, xs, body, closures = _inputs(name, w_grad, b_grad)
    carry, ys = scan_fn(body, init, xs[:length])
    flags = [t.requires_grad for t in carry] + [ys.requires_grad]
    leaves = [t for t in (*init, *closures) if t.requires_grad]
    outs = [t for t in (*carry, ys) if t.requires_grad]
    loss = sum((t.sin() if t.is_floating_point() else t).sum() for t in outs) if outs else None
    grads = list(torch.autograd.grad(loss, leaves, allow_unused=True)) if loss is not None and leaves else []
    grads = [g if g is None else g.detach() for g in grads]
    return flags, [t.detach() for t in (*carry, ys)], grads


@pytest.mark.parametrize("length", [1, 2, 4])
@pytest.mark.parametrize("w_grad,b_grad", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_flags_values_and_grads_are_the_loops(name, w_grad, b_grad, length, traces):
    got = _run(lambda f, i, x: scan(f, i, x, remat=_partition_fn()), name, w_grad, b_grad, length)
    want = _run(reference_scan, name, w_grad, b_grad, length)
    assert got[0] == want[0]
    assert_trees_close(got[1:], want[1:], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(CASES))
def test_body_traces_for_the_flags(name, traces):
    """One joint where the flags are read off it; another trace only where the fixed point is
    short of the guess (a joint there) or the body's run may depend on flags (a flags trace)."""
    _run(lambda f, i, x: scan(f, i, x, remat=_partition_fn()), name, True, True, 4)
    assert traces == CASES[name][3]


@pytest.mark.parametrize("name", sorted(CASES))
def test_on_xla_flags_values_and_grads_are_the_loops(name, traces):
    """The same on XLA's eager path, where a first call takes it (and the body traces counted)."""
    torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA case needs the [xla] extra")
    dev = torch_xla.device()

    def on_xla(f, init, xs):
        moved = tuple(t.detach().to(dev).requires_grad_(t.requires_grad) for t in init)
        carry, ys = scan(f, moved, xs.to(dev))
        return carry, ys

    def run(scan_fn):
        init, xs, body, closures = _inputs(name, True, True)
        closures_dev = [t.detach().to(dev).requires_grad_() for t in closures] if scan_fn is on_xla else closures
        body = CASES[name][2](*closures_dev)
        carry, ys = scan_fn(body, init, xs)
        flags = [t.requires_grad for t in carry] + [ys.requires_grad]
        outs = [t for t in (*carry, ys) if t.requires_grad]
        grads = torch.autograd.grad(sum((t.sin() if t.is_floating_point() else t).sum() for t in outs),
                                    closures_dev, allow_unused=True)
        return flags, [t.detach().cpu() for t in (*carry, ys)], [g if g is None else g.cpu() for g in grads]

    from torch_scan_hop.xla import eager

    eager.clear()  # a first call: traced by make_fx (a second would be Dynamo's capture)
    got, want = run(on_xla), run(reference_scan)
    assert got[0] == want[0]
    assert_trees_close(got[1:], want[1:], atol=1e-9, rtol=1e-9)
    assert traces == CASES[name][3]
