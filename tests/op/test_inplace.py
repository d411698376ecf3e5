"""Bodies that write in place (issue 63), on every path, against the Python loop: values and
gradients. Indexed writes and reads with a 0-d integer tensor index (``buf[:, t] = h``,
``buf[:, t]``, ``index_copy_``), the index from ``with_index`` or carried; in-place ops on the
carry (``c.mul_(a).add_(x)``), also when the body returns the written object itself."""
import pytest
import torch
from conftest import assert_trees_close
from torch.fx.experimental.proxy_tensor import make_fx

from torch_scan_hop import ScanError, scan

D = torch.float64
T, B, H = 4, 2, 3


def recorder(write):
    """A body carrying an RNN state and a (B, T, H) buffer it writes step t into and reads back."""
    def body(carry, x, t):
        h, buf = carry
        h = torch.tanh(h * 0.7 + x)
        write(buf, t, h)
        return (h, buf), buf[:, t] * 2 + buf.sum()
    return body


WRITES = {
    "setitem": lambda buf, t, h: buf.__setitem__((slice(None), t), h),
    "setitem_ellipsis": lambda buf, t, h: buf.__setitem__((Ellipsis, t, slice(None)), h),
    "iadd": lambda buf, t, h: buf.__setitem__((slice(None), t), buf[:, t] + h),
    "index_copy_": lambda buf, t, h: buf.index_copy_(1, t.view(1), h.unsqueeze(1)),
}


def carried_index(body):
    """The same body with the index carried by hand (a 0-d int64 carry; not advanced in place: the
    loop's own backward would find the index it saved for ``buf[:, t]`` modified)."""
    def step(carry, x):
        h, buf, t = carry
        (h, buf), y = body((h, buf), x, t)
        return (h, buf, t + 1), y
    return step


def in_place_carry(c, x):
    c.mul_(0.5).add_(x)  # the new carry is the written input itself
    return c, c * 1.0


def loop(fn, init, xs, *, index):
    carry, ys = init, []
    for i in range(xs.shape[0]):
        carry, y = fn(carry, xs[i], torch.tensor(i)) if index else fn(carry, xs[i])
        ys.append(y)
    return carry, torch.stack(ys)


def data():
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(B, H, dtype=D, generator=g).requires_grad_()
    xs = torch.randn(T, B, H, dtype=D, generator=g).requires_grad_()
    return h0, xs


def outputs_and_grads(out, leaves):
    floats = [t for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point()]
    total = sum((t * (k + 1.5)).sum() for k, t in enumerate(floats))
    return [t.detach() for t in torch.utils._pytree.tree_leaves(out)], torch.autograd.grad(total, leaves)


def traced(f):
    return lambda *a: make_fx(f, tracing_mode="fake")(*a)(*a)


def compiled(backend):
    return lambda f: torch.compile(f, backend=backend, fullgraph=True)


PATHS = {"eager": lambda f: f, "make_fx": traced, "aot_eager": compiled("aot_eager"), "inductor": compiled("inductor")}


def check(path, scan_call, loop_call):
    h0, xs = data()
    got = outputs_and_grads(PATHS[path](scan_call)(h0, xs), (h0, xs))
    h0, xs = data()
    assert_trees_close(got, outputs_and_grads(loop_call(h0, xs), (h0, xs)))


@pytest.mark.parametrize("path,write", [(p, w) for p in ("eager", "make_fx") for w in WRITES]
                         + [("aot_eager", "setitem")])
def test_indexed_write_with_index(path, write):
    body = recorder(WRITES[write])

    def run(h0, xs):
        return scan(body, (h0, h0.new_zeros(B, T, H)), xs, with_index=True)
    check(path, run, lambda h0, xs: loop(body, (h0, h0.new_zeros(B, T, H)), xs, index=True))


@pytest.mark.parametrize("path", ["make_fx", "aot_eager"])
def test_indexed_write_carried_index(path):
    step = carried_index(recorder(WRITES["setitem"]))

    def init(h0):
        return h0, h0.new_zeros(B, T, H), torch.tensor(0)
    check(path, lambda h0, xs: scan(step, init(h0), xs), lambda h0, xs: loop(step, init(h0), xs, index=False))


@pytest.mark.parametrize("path", ["make_fx", "aot_eager"])
def test_in_place_carry(path):
    check(path, lambda h0, xs: scan(in_place_carry, h0 * 1.0, xs),
          lambda h0, xs: loop(in_place_carry, h0 * 1.0, xs, index=False))


def test_inductor():
    """One compile (~6 s): an in-place carry and an indexed write and read."""
    write = WRITES["setitem"]

    def body(carry, x, t):
        c, buf = carry
        c.mul_(0.5).add_(x)
        write(buf, t, torch.tanh(c))
        return (c, buf), buf[:, t] * 2 + buf.sum()

    def init(h0):
        return h0 * 1.0, h0.new_zeros(B, T, H)
    check("inductor", lambda h0, xs: scan(body, init(h0), xs, with_index=True),
          lambda h0, xs: loop(body, init(h0), xs, index=True))


def test_gradcheck_traced():
    """float64 gradcheck of the traced graph (traced once, run per perturbation)."""
    body = recorder(WRITES["setitem"])
    h0, xs = (t.detach()[..., :2].clone().requires_grad_() for t in data())  # H = 2: fewer perturbations
    gm = make_fx(lambda h, x: scan(body, (h, h.new_zeros(B, T, 2)), x, with_index=True)[1],
                 tracing_mode="fake")(h0, xs)
    assert torch.autograd.gradcheck(gm, (h0, xs))


def test_writing_into_x_is_refused():
    def body(c, x):
        x.mul_(2)
        return c + x, c
    h0, xs = data()
    with pytest.raises(ScanError, match="x leaf 0"):
        make_fx(lambda c, xs: scan(body, c, xs), tracing_mode="fake")(h0.detach(), xs.detach())


def select_write(buf, t, h):
    buf.select(1, t).copy_(h)  # the loop writes through the view


@pytest.mark.parametrize("path", ["make_fx"])
def test_select_read_matches_loop(path):
    def body(carry, x, t):
        h, buf = carry
        h = torch.tanh(h * 0.7 + x)
        buf[:, t] = h
        return (h, buf), buf.select(1, t) * 2
    init = (lambda h0: (h0, h0.new_zeros(B, T, H)))
    check(path, lambda h0, xs: scan(body, init(h0), xs, with_index=True),
          lambda h0, xs: loop(body, init(h0), xs, index=True))


@pytest.mark.parametrize("write", [select_write, lambda buf, t, h: buf[:, t].copy_(h)])
@pytest.mark.parametrize("path", ["make_fx", "aot_eager"])
def test_a_write_through_a_tensor_indexed_slice_is_refused(path, write):
    body = recorder(write)
    h0, xs = data()
    with pytest.raises(ScanError, match="write would be lost"):
        PATHS[path](lambda h0, xs: scan(body, (h0, h0.new_zeros(B, T, H)), xs, with_index=True))(h0, xs)


@pytest.mark.parametrize("strict", [True, False])
def test_export(strict):
    body = recorder(WRITES["setitem"])

    class Recorder(torch.nn.Module):  # buf[:, t] = h writes into the carry buf
        def forward(self, h0, xs):
            return scan(body, (h0, h0.new_zeros(B, T, H)), xs, with_index=True)

    h0, xs = data()
    ep = torch.export.export(Recorder(), (h0.detach(), xs.detach()), strict=strict)
    got = outputs_and_grads(ep.module()(h0, xs), (h0, xs))
    h0, xs = data()
    assert_trees_close(got, outputs_and_grads(Recorder()(h0, xs), (h0, xs)))


def cache_writer(cache):
    """A body writing step t into ``cache``, closed over (not carried), and reading it back."""
    def body(c, x, t):
        c = torch.tanh(c * 0.7 + x)
        cache[t] = c
        return c, cache[t].sum() + cache.sum()
    return body


@pytest.mark.parametrize("path", ["make_fx", "export"])
def test_writes_into_a_closed_over_tensor(path):
    """The caller's tensor holds, after the scan, what the loop leaves in it (issue 63 item 3)."""
    def run(h0, xs, cache):
        return scan(cache_writer(cache), h0, xs, with_index=True)

    h0, xs = data()
    want_cache = torch.zeros(T, B, H, dtype=D)
    want = outputs_and_grads(loop(cache_writer(want_cache), h0, xs, index=True), (h0, xs))
    h0, xs = data()
    cache = torch.zeros(T, B, H, dtype=D)
    if path == "make_fx":
        graph = make_fx(run, tracing_mode="fake")(h0, xs, cache)
    else:
        class Writer(torch.nn.Module):
            def forward(self, h0, xs, cache):
                return run(h0, xs, cache)
        graph = torch.export.export(Writer(), (h0.detach(), xs.detach(), cache.clone()), strict=False).module()
    assert_trees_close(outputs_and_grads(graph(h0, xs, cache), (h0, xs)), want)
    torch.testing.assert_close(cache, want_cache.detach())


def test_export_of_a_module_whose_scan_writes_its_buffer_round_trips(tmp_path):
    """A module's registered buffer written by its scan's body (a KV cache's shape): the exported
    program, saved and loaded, gives the loop's outputs and leaves the loop's contents in the
    buffer (issue 63 item 5). The copy back into the buffer ran under no_grad, a grad-mode region
    of the program that torch.export.load rejected."""
    class Writer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(T, B, H, dtype=D))
            self.lin = torch.nn.Linear(H, H, dtype=D)

        def forward(self, h0, xs):
            cache, lin = self.cache, self.lin

            def body(c, x, t):
                c = torch.tanh(lin(c) + x)
                cache[t] = c
                return c, cache[t].sum()
            return scan(body, h0, xs, with_index=True)

    h0, xs = (t.detach() for t in data())
    ref, module = Writer(), Writer()
    module.load_state_dict(ref.state_dict())
    want = ref(h0, xs)
    torch.export.save(torch.export.export(module, (h0, xs), strict=False), tmp_path / "writer.pt2")
    loaded = torch.export.load(tmp_path / "writer.pt2").module()
    assert_trees_close(loaded(h0, xs), want)
    torch.testing.assert_close(loaded.cache, ref.cache)


def test_writes_into_a_closed_over_tensor_under_compile_are_refused():
    h0, xs = data()
    f = torch.compile(lambda h0, xs, cache: scan(cache_writer(cache), h0, xs, with_index=True),
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(ScanError, match=r"closed-over tensor 0.*under torch.compile"):
        f(h0, xs, torch.zeros(T, B, H, dtype=D))


def test_real_make_fx_of_a_tensor_index_says_to_trace_fake():
    """make_fx's real mode traces on uninitialized stand-ins: an index read from them is out of range
    (a ScanError saying what to do) or, by chance, in range (then the graph is right)."""
    body = recorder(WRITES["setitem"])
    h0, xs = data()

    def run(h0, xs):
        return scan(body, (h0, h0.new_zeros(B, T, H)), xs, with_index=True)
    try:
        gm = make_fx(run)(h0, xs)
    except ScanError as e:
        assert "tracing_mode='fake'" in str(e)
        return
    assert_trees_close(gm(h0, xs), loop(body, (h0, h0.new_zeros(B, T, H)), xs, index=True))


def test_in_place_carry_under_compiled_vmap():
    """Dynamo's own input-mutation check misses a write into a vmapped carry (it bumps the batched
    value's version only): the tracker compares the unwrapped versions itself."""
    def f(c, xs):
        return scan(in_place_carry, c * 1.0, xs)[1]

    g = torch.Generator().manual_seed(1)
    c0 = torch.randn(2, B, H, dtype=D, generator=g).requires_grad_()
    xs = torch.randn(2, T, B, H, dtype=D, generator=g)
    got = outputs_and_grads(torch.compile(torch.vmap(f), backend="aot_eager")(c0, xs), (c0,))
    assert_trees_close(got, outputs_and_grads(torch.vmap(f)(c0, xs), (c0,)))


def test_writes_into_a_vmapped_closed_over_tensor_under_compile_are_refused():
    """Dynamo's check misses a write into a vmapped closure as into a vmapped carry; refused when
    Dynamo captures the scan, not later under AOTAutograd's vmap levels, where torch 2.9's cleanup
    masked the ScanError with an internal assert (fuzz seed 20000, func_vmap_compile)."""
    def f(v):
        cache = v * 1.0  # a batched closed-over tensor

        def body(c, x):
            cache.mul_(0.5)
            return c + cache.sum() * x, None
        return scan(body, v.new_zeros(()), v.new_ones(2))[0]

    with pytest.raises(ScanError, match=r"closed-over tensor 0.*under torch.compile"):
        torch.compile(torch.vmap(f), backend="aot_eager", fullgraph=True)(torch.randn(2, 3, dtype=D))
