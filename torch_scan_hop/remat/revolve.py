"""Binomial checkpointing (revolve) for eager ``remat=("binomial", k)``: at most k carries.

``"sqrt"`` keeps T/k carries; revolve keeps a fixed number k and re-runs the
forward from the nearest kept carry, placing new carries where Griewank's
binomial schedule puts them, so that with k carries and r forward sweeps it
reverses beta(k, r) = C(k + r, k) steps. Reversing steps [a, a + n) with s free
slots, the first carry goes to a + d where the remaining n - d steps can be
reversed with s - 1 slots in the same number of sweeps: n - d = beta(s - 1, r),
r the least with beta(s, r) >= n. The backward reaches the steps last to first:
carries past the step it needs are dropped (never needed again), the rest of
the slots are placed on the way from the nearest kept carry to that step.

Cost: each step is run about r + 1 times in all (r from C(k + r, k) >= T), e.g.
T = 4096 with k = 16: r = 4 (C(20, 16) = 4845), against 2 for "sqrt" with 64
carries; the memory is k carries plus one step's activations.
"""
import contextlib
from math import comb

import torch

from ..core.trees import own_copy, requiring_grad


def descent(start, n, free):
    """Where revolve keeps carries (after ``start``) to reverse steps ``start .. start + n - 1``
    with ``free`` slots: the positions the forward sweep from ``start`` stops at."""
    out = []
    while n > 1 and free > 0:
        r = 1
        while comb(free + r, free) < n:
            r += 1
        d = max(1, n - comb(free - 1 + r, free - 1))
        start, n, free = start + d, n - d, free - 1
        out.append(start)
    return out


def advance(engine, pos):
    """The carry step ``pos`` of ``engine`` (a StepReplay) starts from: run forward from the
    nearest kept carry, keeping carries where revolve places them (within ``engine.slots``).
    Steps run with the backward's grad mode: no tape in a plain backward, the forward's
    graph extended under create_graph."""
    carries = engine.carries
    for p in [p for p in carries if p > pos]:
        del carries[p]
    start = max(p for p in carries if p <= pos)
    marks = set(descent(start, pos + 1 - start, engine.slots - len(carries)))
    carry = engine.kept_carry(start)
    with engine.rng_at(start) if len(engine.rng) > 1 else contextlib.nullcontext():
        for p in range(start, pos):
            carry = engine.run_step(p, own_copy(carry))[0]  # (a kept carry stays as it was)
            if not torch.is_grad_enabled():  # as in the forward, so the re-run saves what it saved
                carry = requiring_grad(carry, engine.carry_flags[p + 1])
            if p + 1 in marks:
                carries[p + 1] = carry
    return carry

