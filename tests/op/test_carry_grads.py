"""torch.compile: the carries' requires-grad flags the body is traced with are the loop's (op/carry_grads.py).

A carry requires grad in the traced body iff it does at some step of the Python loop; a
frame that may train speculates the guess "every floating carry requires grad" first and keeps
it only where the speculated graph proves it; the body is then speculated once (counted here,
not timed). Every case compares values, the flags the body saw and the final carry's
requires_grad with the plain loop.
"""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

import torch_scan_hop.op.dynamo as op_dynamo
from torch_scan_hop import scan

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def speculations(monkeypatch):
    """The carries' requires_grad of each speculation of a body, in order."""
    seen, real = [], op_dynamo._Body.speculate

    def spy(self, tx, sub_args, source_target):
        seen.append([op_dynamo.example_of(v).requires_grad for v in sub_args[:self.num_carry]])
        return real(self, tx, sub_args, source_target)

    monkeypatch.setattr(op_dynamo._Body, "speculate", spy)
    return seen


def run_both(step, n_carry=1):
    """(loop's result, compiled result, the carries' flags at each step of the loop). ``step(w, c, x)``
    is the body; the loop's run records what each step's carries require."""
    w = torch.randn(4, 4, requires_grad=True)
    init = tuple(torch.zeros(2, 4) for _ in range(n_carry))
    xs = torch.randn(3, 2, 4)
    loop_seen = []

    def recording(c, x):
        loop_seen.append([t.requires_grad for t in c])
        return step(w, c, x)

    want = reference_scan(recording, init, xs)

    def f(init, xs):  # w in the frame's locals (through the body's closure), as xla/eager's entry
        return scan(lambda c, x: step(w, c, x), init, xs)

    got = torch.compile(f, backend="eager", fullgraph=True)(init, xs)
    return want, got, loop_seen


def any_step(loop_seen):
    """Per carry: whether it required grad at any step of the loop (what the trace must see)."""
    return [any(flags) for flags in zip(*loop_seen)]


def test_a_carry_reading_a_trained_weight_is_speculated_once(speculations):
    def step(w, c, x):
        h = torch.tanh(c[0] @ w + x)
        return (h,), h.sum(-1)

    want, got, loop_seen = run_both(step)
    assert_trees_close(got, want)
    assert loop_seen[0] == [False] and loop_seen[1] == [True]
    assert speculations == [any_step(loop_seen)] == [[True]]
    assert got[0][0].requires_grad == want[0][0].requires_grad


def test_a_carry_not_reached_from_the_weight_keeps_init_flags(speculations):
    """Carry 0 reads w; carry 1 counts steps (floating, so guessed, but nothing it is computed
    from requires grad): the guess is wrong for carry 1, the graph tells the least fixed point."""
    def step(w, c, x):
        h = torch.tanh(c[0] @ w + x)
        return (h, c[1] + 1), h.sum(-1)

    want, got, loop_seen = run_both(step, n_carry=2)
    assert_trees_close(got, want)
    assert speculations[-1] == any_step(loop_seen) == [True, False]
    assert len(speculations) == 2  # the guess, then the least fixed point the graph gave
    assert [t.requires_grad for t in got[0]] == [t.requires_grad for t in want[0]] == [True, False]


def test_a_body_branching_on_the_carry_flag_sees_the_loops_flags(speculations):
    """The body reads its carry's requires_grad: the guess cannot be proven from the graph, the
    flags are iterated from init's, and the loop's (never requiring grad) are what the body sees
    (its y says what it saw: the traced body's is one constant, the flag it was traced with)."""
    def step(w, c, x):
        grad = c[0].requires_grad
        h = c[0] + (w.sum() if grad else 0.0) + x
        return (h if grad else h.detach(),), (h.sum(-1), torch.full((), float(grad)))

    want, got, loop_seen = run_both(step)
    assert_trees_close(got[0], want[0])
    assert all(flags == [False] for flags in loop_seen)
    assert got[1][1].tolist() == want[1][1].tolist() == [0.0] * 3
    assert speculations == [[True], [False]]  # the guess (its graph read the flag), then init's
    assert got[0][0].requires_grad == want[0][0].requires_grad == False  # noqa: E712


def test_a_carry_passed_through_does_not_require_grad(speculations):
    """A fixed point that is not the least: the guessed carry keeps requiring grad only because it
    was guessed to (``c * 2``); the fake run from init's flags finds it does not."""
    def step(w, c, x):
        return (c[0] * 2,), (c[0] @ w).sum(-1)

    want, got, loop_seen = run_both(step)
    assert_trees_close(got, want)
    assert speculations == [[True], any_step(loop_seen)] == [[True], [False]]
    assert got[0][0].requires_grad == want[0][0].requires_grad == False  # noqa: E712


def test_no_guess_without_grad_mode(speculations):
    def step(w, c, x):
        h = torch.tanh(c[0] @ w + x)
        return (h,), h.sum(-1)

    with torch.no_grad():
        want, got, loop_seen = run_both(step)
    assert_trees_close(got, want)
    assert speculations == [[False]]
