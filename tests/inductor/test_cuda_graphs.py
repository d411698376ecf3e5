"""Compiled scans under mode="reduce-overhead" (CUDA graphs) and mode="max-autotune"
(issue 39, item 1), against the Python loop: the forward under no_grad called three
times (the third call replays recorded graphs) and a training step without fullgraph.

On CUDA, cudagraph trees record the graph partitions around the scan's while_loop (its
CPU counter keeps the loop itself out of the graphs) and check that every output they
record is memory of their pool or an alias of an input: the issue saw that check fail
on an output of a partition. max-autotune also runs on the CPU (no CUDA graphs there;
95 s for the forward on a loaded 2-core box, so only with ``SCAN_MAX_AUTOTUNE_CPU=1``).
"""
import os

import pytest
import torch

from torch_scan_hop import scan

T, B, H = 16, 4, 16
HAS_CUDA = torch.cuda.is_available()
CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
SLOW_CPU = pytest.mark.skipif(os.environ.get("SCAN_MAX_AUTOTUNE_CPU") != "1",
                              reason="max-autotune compiles for minutes on 2 cores: SCAN_MAX_AUTOTUNE_CPU=1")
MODES = [pytest.param("reduce-overhead", "cuda", marks=CUDA, id="reduce-overhead-cuda"),
         pytest.param("max-autotune", "cuda", marks=CUDA, id="max-autotune-cuda"),
         pytest.param("max-autotune", "cpu", marks=SLOW_CPU, id="max-autotune-cpu")]


def by_scan(w, c0, xs):
    return scan(lambda c, x: (torch.tanh(c @ w + x), c.sum(-1)), c0, xs)


def by_loop(w, c0, xs):
    c, ys = c0, []
    for x in xs:
        ys.append(c.sum(-1))
        c = torch.tanh(c @ w + x)
    return c, torch.stack(ys)


def _inputs(device, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(H, H, generator=g) * 0.3).to(device).requires_grad_(grad)
    return w, torch.randn(B, H, generator=g).to(device), torch.randn(T, B, H, generator=g).to(device)


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,device", MODES)
def test_forward_under_no_grad_three_calls(mode, device, fresh_dynamo):
    f = torch.compile(by_scan, mode=mode, fullgraph=True)
    outs = []
    with torch.no_grad():
        for call in range(3):  # record, then replay; earlier results stay held
            args = _inputs(device, call)
            with torch._dynamo.config.patch(error_on_recompile=call > 0):
                got = f(*args)
            outs.append([t.clone() for t in got])
            _close(got, by_loop(*args))
    for call, got in enumerate(outs):  # held copies still the loop's: nothing overwritten them
        _close(got, by_loop(*_inputs(device, call)))


@pytest.mark.parametrize("mode,device", MODES)
def test_training_step_without_fullgraph(mode, device, fresh_dynamo):
    def loss_of(fn, w, c0, xs):
        c, ys = fn(w, c0, xs)
        return c.square().sum() + ys.sin().sum()

    f = torch.compile(lambda *a: loss_of(by_scan, *a), mode=mode)
    for call in range(3):
        args = _inputs(device, call, grad=True)
        got = [f(*args)]
        got += torch.autograd.grad(got[0], args[0])
        want = [loss_of(by_loop, *args)]
        want += torch.autograd.grad(want[0], args[0])
        _close([t.detach() for t in got], [t.detach() for t in want])

