"""In a loop run as one C++ kernel (``loop_kernel``), a carried sum that ``scan_blas_addmm``
accumulates (a training backward's weight gradient, ``g = addmm(g, a, b)`` every step) is
accumulated in place: one buffer instead of two used by turns.

Why: the Python loop's code writes ``addmm(g, a, b)`` into the other buffer of a pool of two and
hands that on as the next ``g``, so ATen's ``addmm_impl_cpu_`` (and ``blas``'s kernel, which does
what it does) first copies ``g`` into the output, then calls ``sgemm_`` with beta 1. For the tanh
RNN (H=64) that copy is 4096 floats a step, ~0.4 us of a ~7 us training step; for a 256-wide
layer 64K floats per layer and step. When the output is the buffer ``g`` already lies in, the
copy is ATen's no-op (``c = self``) and ``sgemm_`` gets the same operands, beta and layout: the
same bits, a copy less.

When: the call's output is a pooled buffer at ``step & 1`` and its ``self`` the carried value it
is written back over (the same layout: ``c`` and ``self`` strides equal); no other argument of the
call is that carry or that pool (a gemm may not read its output), no call after it reads the
carry's old value, none before it uses the pool, and no other position is written from the pool.
Then the pool's slot is 0 on every step: step 0 reads the loop's initial value (not written: the
output is the pool's buffer) and writes slot 0; every later step's carry is slot 0 itself.
Anything else is left as the loop kernel wrote it.
"""
from . import pipeline
from .blas import _ADDMM

# scan_blas_addmm(c, self, a, b, ta, tb, m, n, k, lda, ldb, ldc, rows, cols, c_row, c_col, self_row, self_col)
_OUT, _SELF, _C_STRIDES, _SELF_STRIDES = 0, 1, slice(14, 16), slice(16, 18)
_NAME = "accumulate_in_place"


def accumulate_in_place(plan):
    """Rewrite ``plan`` (a ``loop_kernel._Plan``) so that each accumulation the module docstring
    describes writes into the carry's own buffer. Returns the positions so rewritten. Each
    ``scan_blas_addmm`` call counts as ``accumulate_in_place`` applied or skipped
    (``pipeline.pass_counts``); ``passes_off("accumulate_in_place")`` skips them all."""
    done = []
    for i, (kernel, values) in enumerate(plan.call_args):
        if kernel != _ADDMM or len(values) != 18:
            continue
        pool, position = (None, None) if pipeline.is_off(_NAME) else _accumulation(plan, i, values)
        pipeline.record(_NAME, "skipped" if pool is None else "applied")
        if pool is None:
            continue
        slot_any, slot_0 = f"{pool}[step & 1]", f"{pool}[0]"
        plan.calls = [call.replace(slot_any, slot_0) for call in plan.calls]
        plan.writes = [write.replace(slot_any, slot_0) for write in plan.writes]
        head = f"{plan.loop}[{position}] = "
        plan.fixups = [f.replace(f"[({plan.n} - 1) & 1]", "[0]", 1) if f.startswith(head) else f
                       for f in plan.fixups]
        done.append(position)
    return done


def _accumulation(plan, i, values):
    """``(pool's C++ name, carried position)`` when call ``i`` may accumulate in place, else ``(None, None)``."""
    out, self_ = values[_OUT], values[_SELF]
    if out[0] != "tensor" or self_[0] != "tensor" or out[2] is not None or self_[2] is not None:
        return None, None
    if out[3][0] != "pool" or not out[1].endswith("[step & 1]") or self_[3][0] != "carry":
        return None, None
    pool, position = out[1][:-len("[step & 1]")], self_[3][1]
    carry = f"c{position}"
    if values[_C_STRIDES] != values[_SELF_STRIDES]:
        return None, None
    written = plan.written.get(position)
    if written is None or written[1] != out[1]:
        return None, None
    if any(p != position and v[1].startswith(f"{pool}[") for p, v in plan.written.items()):
        return None, None
    others = [v for k, v in enumerate(values) if k not in (_OUT, _SELF) and v[0] == "tensor"]
    if any(v[1] in (carry, out[1]) or v[1].startswith(f"{pool}[") for v in others):
        return None, None
    for j, (_, call_values) in enumerate(plan.call_args):
        bases = [v[1] for v in call_values if v[0] == "tensor"]
        if j > i and carry in bases:
            return None, None  # the old sum read after it was overwritten
        if j < i and any(b.startswith(f"{pool}[") for b in bases):
            return None, None
    return pool, position
