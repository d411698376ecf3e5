"""xla/kept_ys (opt-in, SCAN_XLA_KEEP_YS=1): the While's stacked ys buffers kept between steps.

A kept buffer is the While's initial ys and is then updated in place with the final ys, so
torch_xla donates it to the next step's program: no fill, no fresh pages. The values must be the
loop's whatever holds the buffers: every step of a training loop, a scan's ys or saved values the
caller still holds when the next scan takes the buffer (torch_xla must not donate a shared
buffer), several scans between two syncs (each takes its own buffer or fills one).
"""
import pytest
import torch
from conftest import assert_trees_close, reference_scan

from torch_scan_hop import scan, scan_layers

torch_xla = pytest.importorskip("torch_xla")
from torch_scan_hop.xla import kept_ys  # noqa: E402

DEV = torch_xla.device()


@pytest.fixture
def keep(monkeypatch):
    """The option on, for buffers of any size (these tests' are small), from an empty pool."""
    monkeypatch.setenv(kept_ys.ENV, "1")
    monkeypatch.setattr(kept_ys, "MIN_BYTES", 0)
    monkeypatch.setattr(kept_ys, "_pools", {})
    torch_xla.sync()


def body(c, x):
    c = torch.tanh(c * 0.9 + x)
    return c, c * 2


def loop(c, xs):
    return reference_scan(body, c, xs)


def _xs(seed, length=5):
    torch.manual_seed(seed)
    return torch.randn(length, 3, dtype=torch.float64)


def test_steady_training_steps_match_the_loop_and_reuse_their_buffers(keep):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(4))
    layers = layers.to(torch.float64).to(DEV)
    x = torch.randn(6, 8, dtype=torch.float64).to(DEV)
    for _ in range(4):
        grads = []
        for stacked in (True, False):
            layers.zero_grad(set_to_none=True)
            h = scan_layers(layers, x) if stacked else x
            if not stacked:
                for layer in layers:
                    h = layer(h)
            h.pow(2).mean().backward()
            torch_xla.sync()
            grads.append([p.grad.cpu() for p in layers.parameters()])
        assert_trees_close(grads[0], grads[1], atol=1e-12, rtol=1e-10)
        pools = list(kept_ys._pools.values())
        assert pools and all(len(p) <= kept_ys.PER_SHAPE and not any(e.taken for e in p) for p in pools)  # freed by the sync


def test_ys_the_caller_holds_keep_their_values_when_the_buffer_is_taken_again(keep):
    c0 = torch.zeros(3, dtype=torch.float64)
    first = scan(body, c0.to(DEV), _xs(1).to(DEV))
    torch_xla.sync()
    second = scan(body, c0.to(DEV), _xs(2).to(DEV))  # takes the buffer the first ys share
    torch_xla.sync()
    assert_trees_close([t.cpu() for t in first], list(loop(c0, _xs(1))), atol=1e-12, rtol=1e-12)
    assert_trees_close([t.cpu() for t in second], list(loop(c0, _xs(2))), atol=1e-12, rtol=1e-12)


def test_saved_values_held_across_syncs_give_the_loops_gradients(keep):
    """Two forwards, each synced, then both backwards: the second forward takes the buffers the
    first one's saved values share."""
    xs = [_xs(s).requires_grad_() for s in (3, 4)]
    want = []
    for x in xs:
        c, ys = loop(torch.zeros(3, dtype=torch.float64), x)
        want.append(torch.autograd.grad((c.sum() + ys.pow(2).sum()), x)[0])
    on_dev = [x.detach().to(DEV).requires_grad_() for x in xs]
    losses = []
    for x in on_dev:
        c, ys = scan(body, torch.zeros(3, dtype=torch.float64, device=DEV), x)
        losses.append(c.sum() + ys.pow(2).sum())
        torch_xla.sync()
    got = [torch.autograd.grad(loss, x)[0] for loss, x in zip(losses, on_dev)]
    torch_xla.sync()
    assert_trees_close([g.cpu() for g in got], want, atol=1e-12, rtol=1e-10)


def test_scans_between_two_syncs_each_take_a_buffer_or_fill_one(keep):
    c0 = torch.zeros(3, dtype=torch.float64)
    outs = [scan(body, c0.to(DEV), _xs(s).to(DEV)) for s in range(5)]  # no sync between
    ((key, pool),) = kept_ys._pools.items()
    assert len(pool) == kept_ys.PER_SHAPE and all(e.taken for e in pool)
    torch_xla.sync()
    assert not any(e.taken for e in pool)
    for s, out in enumerate(outs):
        assert_trees_close([t.cpu() for t in out], list(loop(c0, _xs(s))), atol=1e-12, rtol=1e-12)


def test_off_by_default_and_for_small_buffers(monkeypatch):
    monkeypatch.setattr(kept_ys, "_pools", {})
    monkeypatch.delenv(kept_ys.ENV, raising=False)
    c0 = torch.zeros(3, dtype=torch.float64)
    scan(body, c0.to(DEV), _xs(0).to(DEV))
    monkeypatch.setenv(kept_ys.ENV, "1")  # on, but a 5 x 3 buffer is below MIN_BYTES
    out = scan(body, c0.to(DEV), _xs(0).to(DEV))
    torch_xla.sync()
    assert kept_ys._pools == {}
    assert_trees_close([t.cpu() for t in out], list(loop(c0, _xs(0))), atol=1e-12, rtol=1e-12)
