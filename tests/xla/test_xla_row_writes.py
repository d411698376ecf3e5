"""A carried buffer the body writes one row of per step (``buf[t] = h``, ``buf[:, t] = h``) is
written in place on XLA (``xla/row_writes.py``, csrc/hlo_scan.cc "written rows"): the While body
holds a lone dynamic-update-slice of the buffer and no other instruction of its size (no copy,
no fused update, which XLA CPU emits by writing every element), forward and backward (whose
body zeroes the row of the buffer's gradient). Read from the OPTIMIZED HLO, in a child
interpreter started with XLA_FLAGS, as tests/xla/test_xla_stacking.py does. Values and gradients
against the Python loop on the CPU, reverse and unrolled too (``unroll=2``: only the last call of
an iteration leaves its row to the next iteration; the other's write is XLA's fused update). A row
of a later dim (``buf[:, t] = h``) is written into the buffer as the While holds it, its written dim
first (csrc/hlo_rows.h): the lone update is of a ``(LENGTH, BATCH, HIDDEN)`` buffer in both forms."""
import os
import re
import shutil

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed: the XLA tests need the [xla] extra (torch 2.9)")
import _isolated  # noqa: E402
# the stacking tests' dump and child interpreter (one env: one child for both modules)
from test_xla_stacking import _DUMP, _ENV, computations, optimized_scans, stacked_writes_in_loops  # noqa: E402

LENGTH, BATCH, HIDDEN = 37, 2, 3  # per-step values: at most BATCH * HIDDEN elements, under LENGTH


@pytest.fixture(scope="module", autouse=True)
def _remove_dump():
    yield
    shutil.rmtree(_DUMP, ignore_errors=True)


def _step(w, form, read):
    import torch

    def step(carry, x, t):
        h, buf = carry
        h = torch.tanh(h @ w + x + ((buf[t - 1] if form == "rows" else buf[:, t - 1]) if read else 0))
        if form == "rows":
            buf[t] = h  # buf: (LENGTH, BATCH, HIDDEN)
        else:
            buf[:, t] = h  # buf: (BATCH, LENGTH, HIDDEN)
        return (h, buf), h.sum(-1)
    return step


def _run(form, device, *, on_xla, grad, read=False, reverse=False, unroll=1, length=LENGTH):
    """(outputs, gradients w.r.t. w, h0 and xs) of the scan (``on_xla``) or of the Python loop."""
    import torch
    from xla_util import to_cpu, weighted_sum

    from torch_scan_hop import scan

    g = torch.Generator().manual_seed(length + reverse)
    leaves = [torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5, torch.randn(BATCH, HIDDEN, generator=g),
              torch.randn(length, BATCH, HIDDEN, generator=g)]
    w, h0, xs = [t.to(device).requires_grad_(grad) for t in leaves]
    shape = (length, BATCH, HIDDEN) if form == "rows" else (BATCH, length, HIDDEN)
    init, step = (h0 * 1.0, torch.zeros(shape, device=device)), _step(w, form, read)
    if on_xla:
        out = scan(step, init, xs, with_index=True, reverse=reverse, unroll=unroll)
    else:
        carry, ys = init, [None] * length
        for i in (range(length - 1, -1, -1) if reverse else range(length)):
            carry, ys[i] = step(carry, xs[i], torch.tensor(i))
        out = carry, torch.stack(ys)
    grads = torch.autograd.grad(weighted_sum(out), (w, h0, xs)) if grad else None
    return to_cpu((out, grads))


def check_row_writes(form, grad, reverse, unroll, read=False):
    """In the child: values against the loop, then the optimized HLO of every scan While."""
    import torch_xla
    from conftest import assert_trees_close

    dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", "")).group(1)  # the parent's _DUMP
    shutil.rmtree(dump, ignore_errors=True)
    got = _run(form, torch_xla.device(), on_xla=True, grad=grad, reverse=reverse, unroll=unroll, read=read)
    want = _run(form, "cpu", on_xla=False, grad=grad, reverse=reverse, read=read)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    torch_xla.sync()
    scans = optimized_scans(dump)
    found = [line for t in scans for line in stacked_writes_in_loops(t, LENGTH)]
    if unroll == 1:  # unrolled, each call but an iteration's last writes its row at once (fused)
        assert not found, "instructions that write a whole buffer inside a While body:\n" + "\n".join(found)
    buffer = f"f32[{LENGTH},{BATCH},{HIDDEN}]"  # (columns: held with the written dim first)
    assert _row_updates(scans, buffer), "no lone dynamic-update-slice of the buffer in a While body"


def _row_updates(texts, buffer):
    """The While bodies that write a row of ``buffer`` with a lone dynamic-update-slice."""
    bodies = set()
    for text in texts:
        comps, loop_bodies = computations(text)
        for body in loop_bodies:
            if any(opcode == "dynamic-update-slice" and shape == buffer for _, shape, opcode in comps.get(body, [])):
                bodies.add(body)
    return bodies


@pytest.mark.parametrize("form,grad,reverse,unroll,read", [
    ("rows", False, False, 1, False), ("rows", True, True, 1, False), ("rows", True, False, 2, False),
    ("columns", True, True, 1, False), ("columns", True, False, 2, False),
    ("rows", True, True, 1, True), ("columns", True, False, 1, True)])
def test_a_written_row_is_one_in_place_update_per_step(form, grad, reverse, unroll, read):
    """``read``: the body also reads ``buf[t - 1]`` (``buf[:, t - 1]``) before its write (the read sees
    the previous step's row, which the While writes before the step; columns: read from the held
    buffer transposed back). Its backward writes two rows of the buffer's gradient per step (row
    ``t`` zeroed, the read's gradient added into row ``t - 1``), both pending rows of the While."""
    _isolated.call("test_xla_row_writes", "check_row_writes", form, grad, reverse, unroll, read, env=_ENV)


@pytest.mark.parametrize("form", ["rows", "columns"])
def test_a_body_reading_its_buffer_in_straight_line_code_matches_the_loop(form):
    """``buf[t - 1]`` read before the write, in training, unroll=3 over 3 steps: straight-line code
    (each step's rows written at once)."""
    import torch_xla
    from conftest import assert_trees_close

    want = _run(form, "cpu", on_xla=False, grad=True, read=True, length=3)
    got = _run(form, torch_xla.device(), on_xla=True, grad=True, read=True, unroll=3, length=3)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_view_of_a_read_taken_before_the_write_shows_it():
    """``r = buf[t].unsqueeze(0)`` (``buf[:, t].t()``) then ``buf[t] = h``: the loop's ``r`` is a view of
    ``buf`` and holds ``h``; traced for XLA it held the old row (trace/stale_reads.py): values and
    gradients against the loop."""
    import torch
    import torch_xla
    from conftest import assert_trees_close

    from torch_scan_hop import scan

    def body(carry, x, t):
        h, rows, cols = carry
        r, c = rows[t].unsqueeze(0), cols[:, t].t()
        h = torch.tanh(h + x)
        rows[t], cols[:, t] = h, h * 0.5
        return (h + r[0] + c.t(), rows, cols), (r.sum(-1) + c.sum(0)).squeeze(0)

    def run(device, on_xla):
        g = torch.Generator().manual_seed(3)
        h0, xs = (torch.randn(*s, generator=g).to(device).requires_grad_() for s in [(2, 3), (4, 2, 3)])
        init = (h0 * 1.0, torch.zeros(4, 2, 3, device=device), torch.zeros(2, 4, 3, device=device))
        if on_xla:
            out = scan(body, init, xs, with_index=True)
        else:
            carry, ys = init, []
            for i in range(4):
                carry, y = body(carry, xs[i], torch.tensor(i))
                ys.append(y)
            out = carry, torch.stack(ys)
        grads = torch.autograd.grad(sum((t * (k + 1)).sum() for k, t in enumerate([*out[0], out[1]])), (h0, xs))
        return [t.cpu() for t in [*out[0], out[1], *grads]]

    assert_trees_close(run(torch_xla.device(), True), run("cpu", False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unroll", [1, 2])
def test_a_recomputed_step_reads_the_row_the_step_before_wrote(unroll):
    """remat="recompute_all" saves each step's carry input, which the While writes from the step
    before's carry output; a carry whose rows it writes holds that step's row pending there, so the
    saved buffer lacked it and the recomputed step read the old row (fuzz seed 24004: a closed-over
    buffer read at ``t - 1``, ``tanh`` of it the carry): values and gradients against the loop."""
    import torch
    import torch_xla
    from conftest import assert_trees_close

    from torch_scan_hop import scan

    def run(device, on_xla):
        g = torch.Generator().manual_seed(4)
        base, s, xs = (torch.randn(sh, generator=g).to(device).requires_grad_() for sh in [(6, 2, 3), (), (5, 2)])
        buf = base * 1.0

        def body(carry, x, t):
            v = torch.tanh(buf[(t - 1) % 6] * 1.5)
            buf[t] = buf[t] + s * torch.arange(3.0, device=x.device) + x[:, None]
            return carry + v, v.sum()
        if on_xla:
            out = scan(body, torch.zeros(2, 3, device=device), xs, with_index=True, remat="recompute_all",
                       unroll=unroll)
        else:
            carry, ys = torch.zeros(2, 3, device=device), []
            for i in range(5):
                carry, y = body(carry, xs[i], torch.tensor(i))
                ys.append(y)
            out = carry, torch.stack(ys)
        outs = [*out, buf]
        grads = torch.autograd.grad(sum((t * (k + 1)).sum() for k, t in enumerate(outs)), (base, s, xs))
        return [t.detach().cpu() for t in [*outs, *grads]]

    assert_trees_close(run(torch_xla.device(), True), run("cpu", False), rtol=1e-5, atol=1e-5)
