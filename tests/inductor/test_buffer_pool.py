"""The pool behind compiled scans' stacked buffers: storage is handed out again only when no tensor
uses it, so results of calls still alive (two forwards before one backward, kept ys) are never
overwritten; a steady training step reuses its buffers instead of page-faulting them in again."""
import pytest
import torch
from conftest import assert_trees_close

import torch_scan_hop
from torch_scan_hop.inductor import buffer_pool as pool
from torch_scan_hop import scan

BIG = (64, 8, 64)  # float32: 128 KiB, the smallest pooled size


@pytest.fixture(autouse=True)
def empty_pool():
    torch_scan_hop.empty_cache()
    yield
    torch_scan_hop.empty_cache()


def ptr(t):
    return t.untyped_storage().data_ptr()


def test_storage_in_use_is_never_handed_out():
    (a,) = pool.stacked_buffers([(BIG, (512, 64, 1))], torch.float32, torch.device("cpu"))  # the operator
    view = a[3]  # a view keeps the storage in use after the tensor itself is gone
    del a
    b = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, torch.device("cpu"))
    assert ptr(b) != ptr(view)
    view.fill_(1.0)
    b.fill_(2.0)
    assert bool((view == 1.0).all())


def test_idle_storage_is_reused_with_any_layout_of_that_size():
    a = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, torch.device("cpu"))
    first = ptr(a)
    del a
    b = pool.stacked_buffer((64, 64, 8), (1, 512, 64), torch.float32, torch.device("cpu"))  # same span
    assert ptr(b) == first and b.shape == (64, 64, 8) and b.stride() == (1, 512, 64)


def test_small_and_non_cpu_buffers_are_not_pooled():
    small = pool.stacked_buffer((4, 4), (4, 1), torch.float32, torch.device("cpu"))
    assert small.shape == (4, 4) and pool._pooled_bytes() == (0, 0)
    meta = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and pool._pooled_bytes() == (0, 0)


def test_empty_cache_releases_idle_storage_and_the_pool_is_bounded():
    held = [pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, torch.device("cpu"))
            for _ in range(pool._PER_KEY + 3)]
    idle, total = pool._pooled_bytes()
    assert idle == 0 and total == pool._PER_KEY * 128 * 1024  # the oldest ones were forgotten
    del held
    assert pool._pooled_bytes() == (total, total)
    torch_scan_hop.empty_cache()
    assert pool._pooled_bytes() == (0, 0)


def test_new_shapes_keep_at_most_twice_the_largest_request_idle():
    """Changing shapes (a new sequence length every call) must not keep one idle working set per
    shape; storage in use is never released."""
    kept = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, torch.device("cpu"))
    for n in range(64, 80):
        t = pool.stacked_buffer((n, 8, 64), (512, 64, 1), torch.float32, torch.device("cpu"))
        del t
        idle, total = pool._pooled_bytes()
        assert idle <= 2 * 79 * 512 * 4 and total - idle == 128 * 1024
    kept.fill_(1.0)
    assert bool((kept == 1.0).all())


def test_two_working_sets_in_turn_both_stay_pooled():
    """A training and an evaluation step of other shapes, in turn: each finds its own storage
    again (releasing all other sizes on a miss made them evict each other on every call)."""
    cpu = torch.device("cpu")
    sets = {"train": [(BIG, (512, 64, 1)), ((64, 8, 128), (1024, 128, 1))], "eval": [((64, 8, 96), (768, 96, 1))]}
    seen = {}
    for round_ in range(3):
        for name, shapes in sets.items():
            bufs = pool.stacked_buffers(shapes, torch.float32, cpu)
            ptrs = [ptr(b) for b in bufs]
            assert round_ == 0 or ptrs == seen[name]
            seen[name] = ptrs
            del bufs


CPU = torch.device("cpu")
TRAIN = [(BIG, (512, 64, 1)), ((64, 8, 128), (1024, 128, 1)), ((4, 4), (4, 1))]  # two pooled, one small


def test_a_repeated_request_gets_the_same_storage_while_idle_and_never_while_busy():
    """The per-signature fast path (a steady step's buffers handed out again without a search)
    hands storage out only when nothing uses it, as plain, non-view tensors of the asked layout."""
    first = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    ptrs = [ptr(b) for b in first[:2]]
    assert all(b._base is None and not b._is_view() for b in first)
    assert [(b.shape, b.stride()) for b in first] == [(torch.Size(s), st) for s, st in TRAIN]
    kept = first[1][2]  # a view keeps the second buffer busy
    del first
    second = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    assert ptr(second[0]) == ptrs[0] and ptr(second[1]) != ptrs[1]
    kept.fill_(1.0)
    second[1].fill_(2.0)
    assert bool((kept == 1.0).all())
    del second, kept
    third = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    assert ptr(third[0]) == ptrs[0]
    del third
    assert pool._pooled_bytes()[0] == pool._pooled_bytes()[1]  # all idle again: nothing leaked as busy


def test_storage_released_by_empty_cache_or_trimming_is_not_handed_out_again():
    """The fast path remembers a signature's storage; once the pool lets that storage go it must
    not come back from memory (it would be pooled storage the pool no longer counts)."""
    a = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    del a
    torch_scan_hop.empty_cache()
    b = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    assert pool._pooled_bytes() == (0, 128 * 1024 + 256 * 1024)  # counted again, all of it busy
    del b
    for n in range(140, 180):  # other sizes, one after another: trimming releases the idle TRAIN storage
        t = pool.stacked_buffer((n, 8, 64), (512, 64, 1), torch.float32, CPU)
        del t
    assert not {(128 * 1024, CPU), (256 * 1024, CPU)} & set(pool._pool)
    c = pool.stacked_buffers(TRAIN, torch.float32, CPU)
    idle, total = pool._pooled_bytes()
    assert total - idle == 128 * 1024 + 256 * 1024
    del c


def test_one_storage_serves_several_dtypes_and_still_counts_as_idle():
    f32 = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, CPU)
    first = ptr(f32)
    del f32
    f64 = pool.stacked_buffer((32, 8, 64), (512, 64, 1), torch.float64, CPU)  # the same bytes
    assert ptr(f64) == first and f64.dtype == torch.float64
    del f64
    again = pool.stacked_buffer(BIG, (512, 64, 1), torch.float32, CPU)
    assert ptr(again) == first
    del again
    assert pool._pooled_bytes() == (128 * 1024, 128 * 1024)


def rnn(w):
    def cell(c, x):
        h = torch.tanh(c @ w + x)
        return h, h * 2
    return cell


def loop(w, c, xs):
    ys = []
    for x in xs:
        c, y = rnn(w)(c, x)
        ys.append(y)
    return c, torch.stack(ys)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_calls_alive_together_keep_their_own_buffers():
    """Two forwards before one backward (gradient accumulation): the second call's ys and saved
    activations must not take the first call's storage."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=gen, dtype=torch.float64) / 8).requires_grad_()
    c0 = torch.randn(8, 64, generator=gen, dtype=torch.float64)  # float64: a wrong buffer is no rounding error
    xs1, xs2 = torch.randn(2, *BIG, generator=gen, dtype=torch.float64).unbind(0)
    compiled = torch.compile(lambda w, c, xs: scan(rnn(w), c, xs), backend="inductor", fullgraph=True)
    for _ in range(2):  # the second round runs on reused storage
        out1 = compiled(w, c0, xs1)
        out2 = compiled(w, c0, xs2)
        assert ptr(out1[1]) != ptr(out2[1])
        (g,) = torch.autograd.grad(out1[1].sum() + out2[1].pow(2).sum() + out1[0].sum(), w)
        ref1, ref2 = loop(w, c0, xs1), loop(w, c0, xs2)
        (g_ref,) = torch.autograd.grad(ref1[1].sum() + ref2[1].pow(2).sum() + ref1[0].sum(), w)
        assert_trees_close((out1, out2, g), (ref1, ref2, g_ref))
        del out1, out2, g


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_steady_compiled_step_reuses_its_stacked_buffers():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 64, generator=gen, dtype=torch.float64) / 8).requires_grad_()
    c0, xs = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((8, 64), BIG))
    compiled = torch.compile(lambda w, c, xs: scan(rnn(w), c, xs), backend="inductor", fullgraph=True)
    _, ys = compiled(w, c0, xs)
    ys.sum().backward()
    first = ptr(ys)
    del ys
    w.grad = None
    _, ys = compiled(w, c0, xs)
    assert ptr(ys) == first
    ys.sum().backward()
    assert_trees_close((ys, w.grad), (loop(w, c0, xs)[1], torch.autograd.grad(loop(w, c0, xs)[1].sum(), w)[0]))


@pytest.mark.usefixtures("fresh_dynamo")
def test_dynamic_lengths_get_their_buffers_from_one_compiled_graph():
    """``dynamic=True``: the buffers' sizes reach the pool's operator at run time (its symbols), so
    every length gets buffers of its own shape, values and gradients those of the loop."""
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 64, generator=gen, dtype=torch.float64) / 8).requires_grad_()
    c0 = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    compiled = torch.compile(lambda w, c, xs: scan(rnn(w), c, xs), backend="inductor", dynamic=True, fullgraph=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for length in (40, 64, 70):
        xs = torch.randn(length, 8, 64, generator=gen, dtype=torch.float64)
        out = compiled(w, c0, xs)
        assert out[1].shape == (length, 8, 64)
        ref = loop(w, c0, xs)
        grads = torch.autograd.grad(out[0].sum() + out[1].pow(2).sum(), w)
        ref_grads = torch.autograd.grad(ref[0].sum() + ref[1].pow(2).sum(), w)
        assert_trees_close((out, grads), (ref, ref_grads))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
