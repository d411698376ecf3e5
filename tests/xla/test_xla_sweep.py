"""XLA: a seeded sweep over shapes, carry dtypes, lengths, unroll and reverse.

Each case scans a body with a float32 carry, optionally a bfloat16 and an int
carry, a closure read twice, and float and int ys; values and gradients (for
w, the float carries and xs) must match the Python loop on CPU. Lengths cover
0, 1 and lengths that are not a multiple of unroll (a remainder segment).
"""
import random

import pytest
import torch
from conftest import assert_trees_close
from xla_util import DEV, assert_matches_loop, run


def _case(seed):
    rng = random.Random(seed)
    return dict(seed=seed, batch=rng.randint(1, 3), feat=rng.randint(1, 5), length=rng.choice([1, 2, 4, 5, 7]),
                unroll=rng.choice([1, 2, 3]), reverse=rng.random() < 0.5, bf16=rng.random() < 0.5,
                int_carry=rng.random() < 0.5)


CASES = [_case(s) for s in range(10)] + [
    dict(seed=100, batch=2, feat=3, length=7, unroll=3, reverse=True, bf16=True, int_carry=True),
    dict(seed=101, batch=2, feat=3, length=1, unroll=2, reverse=False, bf16=False, int_carry=True),
    dict(seed=102, batch=1, feat=4, length=0, unroll=1, reverse=True, bf16=True, int_carry=False),
    dict(seed=104, batch=2, feat=2, length=0, unroll=3, reverse=False, bf16=False, int_carry=True),
    dict(seed=105, batch=2, feat=3, length=2, unroll=3, reverse=True, bf16=False, int_carry=False),
    dict(seed=103, batch=3, feat=2, length=5, unroll=2, reverse=False, bf16=False, int_carry=False),
]


def _id(case):
    return "L{length}-u{unroll}-{d}{r}{b}{i}-s{seed}".format(
        d=f"{case['batch']}x{case['feat']}", r="-rev" if case["reverse"] else "",
        b="-bf16" if case["bf16"] else "", i="-int" if case["int_carry"] else "", **case)


def make_body(w):
    def body(c, x):
        h = torch.tanh(c["h"] @ w + x["a"] * w.sum(0))  # w read twice
        new, y = {"h": h}, {"h": h * 2 + x["b"].unsqueeze(-1)}
        if "m" in c:
            new["m"] = c["m"] * 0.5 + h.to(torch.bfloat16)
            y["m"] = new["m"].sum(-1)
        if "n" in c:
            new["n"] = c["n"] + (x["a"].sum(-1) > 0).long()
            y["n"] = new["n"] * 3
        return new, y
    return body


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_values_and_grads_match_loop(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, f, n = case["batch"], case["feat"], case["length"]
    init = {"h": torch.randn(b, f, generator=g)}
    if case["bf16"]:
        init["m"] = torch.randn(b, f, generator=g).to(torch.bfloat16)
    if case["int_carry"]:
        init["n"] = torch.randint(0, 5, (b,), generator=g)
    xs = {"a": torch.randn(n, b, f, generator=g), "b": torch.randn(n, b, generator=g)}
    w = torch.randn(f, f, generator=g) * 0.5
    tol = 2e-2 if case["bf16"] else 1e-5
    options = dict(grad=True, reverse=case["reverse"], unroll=case["unroll"])
    if n:
        assert_matches_loop(make_body, [w], init, xs, atol=tol, rtol=tol, **options)
        return
    # length 0: the loop never calls fn, so it cannot know the ys; compare the
    # carry and grads, and check the ys are empty stacks
    (carry, ys), grads = run(make_body, [w], init, xs, DEV, loop=False, **options)
    (want_carry, _), want_grads = run(make_body, [w], init, xs, "cpu", loop=True, **options)
    assert_trees_close((carry, grads), (want_carry, want_grads), atol=tol, rtol=tol)
    assert all(y.shape[0] == 0 for y in ys.values())
