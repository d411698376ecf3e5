"""A ``y`` written straight into its row of the ys buffer (``write_extern_outputs_into_rows``).

A scan body's ``row.copy_(y)`` into the stacked ys costs a copy per step when ``y`` is an
extern kernel's output (every weight gradient of a training backward) or a reduction's; inductor
lets such a kernel write the row itself, as it does for the inputs of a ``cat``. Installed by
``inductor.lowering``; the inductor internals it reads are ``_compat.inductor``'s adapters.
"""
import sympy
import torch

from .. import _compat
from . import wrapper_patches

_inductor = _compat.inductor


def write_extern_outputs_into_rows(in_scan_body):
    """In a graph that ``in_scan_body(name)`` accepts, lower ``row.copy_(y)``
    (``row`` a view of an input buffer: a scan's ys buffer) by letting ``y``'s
    extern kernel (``extern_kernels.mm``/``addmm``/``bmm``: every weight
    gradient of a training backward, saved matmul outputs) or reduction
    kernel write the row itself, as inductor does for the inputs of a ``cat``:
    the output buffer becomes a non-owning view of the row. Anywhere else, and where
    that is not exactly a copy (``_extern_output_into``), inductor's own
    ``copy_`` lowering runs unchanged. Not idempotent: call once.
    The inductor names are ``_compat.inductor``'s (``ir``, ``virtualized``, ``lowerings``)."""
    lowerings, V = _inductor.lowerings(), _inductor.virtualized()
    op = torch.ops.aten.copy_.default
    copy_ = lowerings[op]
    wrapper_patches.allocate_no_input_buffers()

    def copy_into_row(dst, src, non_blocking=False):
        if in_scan_body(getattr(V.graph, "name", None) or "") and _extern_output_into(dst, src):
            return dst
        return copy_(dst, src, non_blocking)

    lowerings[op] = copy_into_row


def _extern_output_into(dst, src):
    """Make ``src``'s extern kernel write ``dst`` directly when that is the
    same as copying it there; True if done."""
    ir, V = _inductor.ir(), _inductor.virtualized()

    node = V.graph.current_node
    if node is None or len(node.args) < 2 or any(u.op == "output" for u in getattr(node.args[1], "users", ())):
        return False  # a y that is also a carry must not alias the ys buffer
    row = _row_view(dst)
    kernel = _extern_kernel_of(src)
    if row is None or kernel is None or _mutated_by_another_op(kernel):
        return False
    base = row.data.data
    if base.get_name() in kernel.get_read_names():
        return False
    lay, rlay, sv = kernel.layout, row.layout, V.graph.sizevars

    def equal(a, b):
        return len(a) == len(b) and all(sv.statically_known_equals(p, q) for p, q in zip(a, b))

    dense = ir.FlexibleLayout.contiguous_strides(rlay.size)
    if not (lay.dtype == rlay.dtype and lay.device == rlay.device and equal(lay.size, rlay.size)
            and equal(rlay.stride, dense) and sv.statically_known_equals(lay.offset, 0)
            and (isinstance(lay, ir.FlexibleLayout) or equal(lay.stride, rlay.stride))):
        return False  # not the whole output, or not dense in the row's layout
    if type(kernel) is ir.ComputedBuffer and sympy.Mod(rlay.offset * rlay.dtype.itemsize, 16) != 0:
        return False  # a kernel's output must start 16-byte aligned (torch 2.15's while_loop checks it)
    kernel.layout = ir.NonOwningLayout(row)
    V.graph.never_reuse_buffers.add(kernel.get_name())  # its storage is the row: never handed on
    V.graph.mark_buffer_mutated(base.get_name())
    _also_uses_symbols_of(kernel, rlay.offset)
    return True


def _mutated_by_another_op(kernel):
    """Some other operation writes into ``kernel``'s buffer after it is computed: ``y =
    zeros.index_put_(ids, g, accumulate=True)`` (the gradient of ``b[ids]``: every MoE expert
    bias's) is a ``full`` kernel then a scatter into its buffer. Moving the ``full`` into the
    row lost the scatter (the row got the zeros: the gradient was 0), so such a ``y`` is copied
    into its row as inductor copies it."""
    V = _inductor.virtualized()
    name = kernel.get_name()
    return any(name in op.get_mutation_names() for op in V.graph.operations if op is not kernel)


def _row_view(dst):
    """``dst`` (a TensorBox) as a ReinterpretView of an input buffer, or None."""
    ir = _inductor.ir()

    data = getattr(dst, "data", None)
    if not isinstance(data, ir.BaseView):
        return None
    try:
        view = ir.ExternKernel.convert_to_reinterpret_view(data)
    except Exception:  # noqa: BLE001 - not strides over one buffer: copy as usual
        return None
    box = view.data
    if not (isinstance(box, ir.StorageBox) and isinstance(box.data, ir.InputBuffer)):
        return None
    return view


def _extern_kernel_of(src):
    """The buffer that is the whole of ``src``, its layout still its own (not yet
    aliased elsewhere): a plain extern kernel call, or a reduction (realized here:
    a ``y = c.sum(-1)`` was computed into a buffer of its own and copied into the
    row, an allocation and a copy per step), else None. An unrealized pointwise
    ``src`` needs none of this: inductor's ``copy_`` computes it into the row."""
    ir = _inductor.ir()

    box = getattr(src, "data", None)
    if not isinstance(box, ir.StorageBox):
        return None
    if isinstance(box.data, ir.Reduction):
        box.realize()
    kernel = box.data
    if type(kernel) is ir.ExternKernelOut and type(kernel.layout) in (ir.FixedLayout, ir.FlexibleLayout):
        return kernel
    if type(kernel) is ir.ComputedBuffer and type(kernel.layout) is ir.FlexibleLayout:
        return kernel
    return None


def _also_uses_symbols_of(kernel, offset):
    """The kernel now writes at an offset of the loop index (an unbacked
    symbol): the scheduler must place it after the index is read, and it only
    orders kernels by the symbols they use."""
    get_free_symbols = _inductor.free_symbols
    if not get_free_symbols(offset, True):
        return
    uses = kernel.get_free_symbol_uses

    def get_free_symbol_uses(unbacked_only=False):
        return uses(unbacked_only) | get_free_symbols(offset, unbacked_only)

    kernel.get_free_symbol_uses = get_free_symbol_uses
