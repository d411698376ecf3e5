import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

import torch_scan_hop  # noqa: E402,F401

try:  # start the XLA runtime before any backward: the autograd engine sizes its
    import torch_xla  # per-device queues at its first use, and an XLA backward
    torch_xla.device()  # after that would hit an internal assert
except ImportError:
    pass


def capture_graphs():
    """A torch.compile backend that records the graphs Dynamo hands it (and runs them as they are)."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


@pytest.fixture
def engines(monkeypatch):
    """The eager remat engines (``remat.replay.StepReplay``) the test's scans make, in order."""
    from torch_scan_hop.remat import replay

    made = []
    init = replay.StepReplay.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(replay.StepReplay, "__init__", spy)
    return made


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after the test."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def reference_scan(fn, init, xs=None, *, length=None, reverse=False, dim=0):
    """The plain Python for-loop every test compares against."""
    leaves, spec = pytree.tree_flatten(xs)  # None leaves (no value) stay None in every x
    tensors = [t for t in leaves if t is not None]
    n = length if not tensors else tensors[0].shape[dim]
    order = range(n - 1, -1, -1) if reverse else range(n)
    carry, ys = init, [None] * n
    for i in order:
        x = None if xs is None else pytree.tree_unflatten([t if t is None else t.select(dim, i) for t in leaves], spec)
        carry, ys[i] = fn(carry, x)
    if n == 0:
        return carry, None
    y_leaves = [pytree.tree_flatten(y)[0] for y in ys]
    stacked = [None if col[0] is None else torch.stack(col) for col in zip(*y_leaves)]
    return carry, pytree.tree_unflatten(stacked, pytree.tree_flatten(ys[0])[1])


def assert_trees_close(got, want, **kw):
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    assert gs == ws, f"structure {gs} != {ws}"
    for a, b in zip(g, w):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert a.shape == b.shape, (a.shape, b.shape)
        torch.testing.assert_close(a, b, **kw)


def loops_in(code):
    """Host-side loops in inductor's generated code: its own ``while`` loops, and the
    ``for <loop>_step in range(n)`` our static-length scans are generated as."""
    return code.count("while ") + code.count("_step in range(")
