"""Inductor scans whose body returns views at a storage offset (slices of a concatenation), as a
DTensor body does when it gathers an uneven shard padded and slices it: the loop's outputs are
such views, which inductor asserted 16-byte aligned ("Expect the tensor to be 16 bytes aligned",
torch 2.9-2.15: ``inductor/workarounds.py``, defect 8). Values and gradients against the loop."""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def sliced_body(w):
    """New carry and y: rows of concatenations, at offsets of 5 and 1 floats (not 16 bytes)."""
    def body(c, x):
        g = torch.cat([torch.sin(x[:1]), c @ w], 0)  # rows 1: of a (1 + B, 5) buffer
        y = torch.cat([x.sum(0), c.sum(0)])[1:]  # elements 1: of a (10,) buffer
        return g[1:], y
    return body


DEVICES = {"cpu": (), "cuda": pytest.mark.skipif(not torch.cuda.is_available(),
                                                 reason="Triton's alignment assumptions need a CUDA device")}


def _schedules():
    """(unroll, reverse, dynamic, device): all 8 on CUDA, where the alignment matters; on the CPU the
    half whose factors' parities sum to even, which still meets every pair of factor values (8 cases
    took ~100 s of a CI run on torch 2.15)."""
    for name, marks in DEVICES.items():
        yield from (pytest.param(u, r, d, name, marks=marks, id=f"{r}-{d}-{u}-{name}") for u in (1, 2)
                    for r in (False, True) for d in (False, True) if name != "cpu" or (u - 1 + r + d) % 2 == 0)


@pytest.mark.parametrize("unroll,reverse,dynamic,device", list(_schedules()))
def test_carry_and_y_sliced_from_a_concatenation(unroll, reverse, dynamic, device):
    gen = torch.Generator().manual_seed(unroll + 2 * reverse)
    c0, xs, w = (torch.randn(*s, generator=gen, dtype=torch.float64).to(device)
                 for s in ((2, 5), (3, 2, 5), (5, 5)))

    def step(scan_fn, c0, xs, w):
        leaves = [t.clone().requires_grad_() for t in (c0, xs, w)]
        c, ys = scan_fn(sliced_body(leaves[2]), leaves[0], leaves[1], reverse=reverse)
        loss = c.square().sum() + ys.sin().sum()
        return c.detach(), ys.detach(), torch.autograd.grad(loss, leaves)

    want = step(reference_scan, c0, xs, w)
    ours = lambda fn, c, x, reverse: scan(fn, c, x, reverse=reverse, unroll=unroll)  # noqa: E731
    got = torch.compile(lambda *a: step(ours, *a), backend="inductor", dynamic=dynamic)(c0, xs, w)
    assert_trees_close(got, want, atol=1e-9, rtol=1e-7)
