"""A carried buffer the body writes one row of per step (``buf[t] = h``, ``buf[:, t] = h``) is
written in place under inductor (``inductor/row_writes.py``): the loop gives the new carry no
buffer of its own and copies nothing of the old one, in the forward and in the backward (whose
body zeroes the row of the buffer's gradient). Values and gradients (float64) against the Python
loop; the generated code is read for any buffer of the carried buffers' shapes made in a loop
(the backward's gradient of the ``rows[t - 1]`` read was one: a zero buffer scattered into and
added, folded into the row writes)."""
import re

import torch
from conftest import assert_trees_close
from torch._inductor.utils import run_and_get_code

from torch_scan_hop import scan
from torch_scan_hop.inductor import row_writes

T, B, H = 11, 2, 5
D = torch.float64


def body(w):
    def step(carry, x, t):
        h, rows, cols = carry
        h = torch.tanh(h @ w + x + rows[t - 1] * 0.5)  # the row before (the last at t = 0)
        rows[t] = h  # rows: (T, B, H)
        cols[:, t] = h * 2  # cols: (B, T, H)
        return (h, rows, cols), None
    return step


def loop(w, h0, xs, rows, cols):
    carry = (h0, rows.clone(), cols.clone())  # the scan writes no input: the loop on copies
    for i in range(T):
        carry, _ = body(w)(carry, xs[i], torch.tensor(i))
    return carry


def scanned(w, h0, xs, rows, cols):
    return scan(body(w), (h0, rows, cols), xs, with_index=True)[0]


def values_and_grads(fn, inputs):
    out = fn(*inputs)
    gen = torch.Generator().manual_seed(3)
    total = sum((o * torch.randn(o.shape, generator=gen, dtype=D)).sum() for o in out)
    return [o.detach() for o in out], torch.autograd.grad(total, inputs[:3])


def inputs():
    """w, h0, xs (requiring grad) and the buffers' inits (their last rows are read at t = 0)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(H, H, generator=gen, dtype=D) * 0.4).requires_grad_(),
            torch.randn(B, H, generator=gen, dtype=D).requires_grad_(),
            torch.randn(T, B, H, generator=gen, dtype=D).requires_grad_(),
            torch.randn(T, B, H, generator=gen, dtype=D), torch.randn(B, T, H, generator=gen, dtype=D)]


def allocations_in_loops(code, shapes):
    """Lines of the counted loops (their set-up line, which makes the pools, and their bodies,
    also where left as comments) that make a buffer of one of ``shapes``."""
    wanted = [f"empty_strided_cpu({shape}" for shape in shapes]
    lines, found = code.split("\n"), []
    for i, line in enumerate(lines):
        loop = re.match(r"^(\s*)for \w+_step in range\(", line)
        if not loop:
            continue
        inside = [lines[i - 1]]
        for after in lines[i + 1:]:
            if after.strip() and len(after) - len(after.lstrip()) <= len(loop.group(1)):
                break
            inside.append(after)
        found += [t for t in inside if any(w in t for w in wanted)]
    return found


def test_rows_written_in_place_in_both_directions():
    before = row_writes.counts().get("in_place", 0)
    torch._dynamo.reset()
    compiled = torch.compile(scanned, backend="inductor", fullgraph=True)
    given = inputs()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(lambda: values_and_grads(compiled, given))
    assert_trees_close(got, values_and_grads(loop, inputs()))
    assert_trees_close(given[3:], inputs()[3:])  # the inits the loop wrote in place are the caller's, unchanged
    assert row_writes.counts()["in_place"] - before == 4  # two buffers, forward and backward
    shapes = [f"({T}, {B}, {H}), ({B * H}, {H}, 1)", f"({B}, {T}, {H}), ({T * H}, {H}, 1)"]
    assert len(codes) == 2 and not [line for c in codes for line in allocations_in_loops(c, shapes)]


def test_the_code_check_finds_an_allocation_in_a_loop():
    code = "\n".join([
        "    buf3 = [buf1, buf2]; buf3_pool0 = (empty_strided_cpu((11, 5), (5, 1), torch.float64),)",
        "    for buf3_step in range(11):",
        "        a = empty_strided_cpu((11, 2), (2, 1), torch.float64)",
        "        # b = empty_strided_cpu((11, 5), (5, 1), torch.float64)",
        "    c = empty_strided_cpu((11, 5), (5, 1), torch.float64)"])
    assert len(allocations_in_loops(code, ["(11, 5), (5, 1)"])) == 2


def test_a_buffer_read_after_its_write_keeps_its_copy():
    """``buf[t] = h`` then ``buf.sum()``: the write's result is read, so the loop keeps a copy
    (``kept``), and the values and gradients are the loop's (graph-level check: no compile)."""
    import torch.fx

    def step(buf, h, t):
        new = torch.ops.aten.index_put.default(buf, [t], h)
        return new, new.sum()

    gm = torch.fx.symbolic_trace(step)
    before = dict(row_writes.counts())
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(T, H) if node.name in ("buf", "index_put") else None
    assert row_writes.write_in_place(gm, 1) == (gm, frozenset())
    assert row_writes.counts().get("kept", 0) == before.get("kept", 0) + 1
