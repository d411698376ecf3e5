"""Inductor internals: the post-grad scan pass, its pattern matcher, and the
subgraph lowering that scan's while_loops go through.

Checked against torch 2.14's ``torch/_inductor``: ``post_grad`` still looks
``decompose_scan_to_while_loop`` up by name when its passes run, still has
``resolve_shape_to_proxy(shape, bound_symbols)``; ``PatternMatcherPass`` adds
an optional ``subsystem``; ``SubgraphLowering.__init__`` still inherits the
parent's ``bw_donated_idxs`` (the fix in ``_inductor_fixes`` is still needed);
``ir.NonOwningLayout``, ``ExternKernelOut`` and ``never_reuse_buffers`` are
unchanged, and 2.14's wrapper no longer allocates input buffers (2.9's does:
``_allocate_no_input_buffers``).
"""
import functools


def post_grad_module():
    """``torch._inductor.fx_passes.post_grad`` (torch 2.9-2.14), whose
    module-level pass functions are looked up by name each compile."""
    from torch._inductor.fx_passes import post_grad

    return post_grad


def run_before_scan_decomposition(before):
    """Make inductor's post-grad pass ``decompose_scan_to_while_loop`` call
    ``before(gm)`` first, then upstream's pass. Not idempotent: call once.

    Inductor has no hook for a pass ahead of its scan decomposition; the
    module attribute is replaced (``post_grad`` looks it up at run time on
    torch 2.9 and 2.14 alike)."""
    post_grad = post_grad_module()
    upstream = post_grad.decompose_scan_to_while_loop

    @functools.wraps(upstream)
    def decompose_scans(gm):
        before(gm)
        return upstream(gm)

    post_grad.decompose_scan_to_while_loop = decompose_scans


def call_pattern_pass(target, extra_check, handler):
    """A pattern pass (``.apply(gm)``) that calls ``handler(match, *args,
    **kwargs)`` for each ``call_function`` node of ``target`` passing
    ``extra_check(match)``; ``match.nodes`` and ``match.replace_by_example``
    are the pattern matcher's. torch 2.9-2.14: ``torch._inductor.pattern_matcher``
    (2.14's PatternMatcherPass takes an optional ``subsystem``, unused here)."""
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, PatternMatcherPass, register_graph_pattern

    pass_ = PatternMatcherPass()
    register_graph_pattern(CallFunctionVarArgs(target), extra_check=extra_check, pass_dict=pass_)(handler)
    return pass_


def resolve_shape_to_proxy(shape, symbols):
    """Sizes or strides with symbols replaced by traced values computed from
    ``symbols`` ({sympy symbol: SymInt}). Upstream's scan decomposition
    preallocates its ys this way. torch 2.9-2.14: same function in ``post_grad``."""
    from torch._inductor.fx_passes.post_grad import resolve_shape_to_proxy as resolve

    return resolve(shape, symbols)


def run_after_subgraph_lowering_init(after):
    """Call ``after(lowering)`` at the end of every ``SubgraphLowering.__init__``
    (a while_loop's cond and body graphs are lowered by one). Not idempotent:
    call once. torch 2.9-2.14: ``torch._inductor.graph.SubgraphLowering``."""
    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        after(self)

    SubgraphLowering.__init__ = __init__


def skip_input_asserts_of_subgraphs(skipped):
    """Leave out the per-call input size/stride asserts of the subgraphs whose
    name ``skipped(name)`` accepts. A while_loop's cond and body are called once
    per iteration and assert every carried input each time (~1.3 us each,
    ~140 per decoder layer of a training step); their layouts are fixed by the
    while_loop lowering, and the outer graph still asserts its own inputs. Not
    idempotent: call once. torch 2.9-2.14:
    ``torch._inductor.codegen.wrapper.SubgraphPythonWrapperCodegen`` (with
    ``subgraph_name``), whose ``codegen_input_size_asserts`` is inherited."""
    from torch._inductor.codegen.wrapper import SubgraphPythonWrapperCodegen

    asserts = SubgraphPythonWrapperCodegen.codegen_input_size_asserts

    def codegen_input_size_asserts(self):
        if skipped(getattr(self, "subgraph_name", "")):
            return None
        return asserts(self)

    SubgraphPythonWrapperCodegen.codegen_input_size_asserts = codegen_input_size_asserts


def register_row_write_lowering(op):
    """Lower ``op(buf, i, y)`` (``buf[i] = y``, ``buf`` a carried input of a
    while_loop body). When ``y`` is the output of an extern kernel call
    (``extern_kernels.mm``/``addmm``/``bmm``: every weight gradient of a
    training backward, many saved activations) laid out densely as the row,
    the kernel writes into the row itself: its output buffer becomes a
    non-owning view of the row, as inductor does for ``cat`` inputs. Otherwise
    a copy (``select`` + ``copy_``, fused into y's kernel where it can be).
    torch 2.9-2.14: ``ir.NonOwningLayout``, ``ir.ExternKernelOut``,
    ``V.graph.never_reuse_buffers``, ``register_lowering``."""
    import torch
    from torch._inductor.lowering import lowerings, register_lowering

    aten = torch.ops.aten
    _allocate_no_input_buffers()

    @register_lowering(op, type_promotion_kind=None)
    def write_row(buf, i, y):
        if not _write_into_row(buf, i, y):
            lowerings[aten.copy_.default](lowerings[aten.select.int](buf, 0, i), y)
        return None


def _write_into_row(buf, i, y):
    import sympy
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    fx_y = V.graph.current_node.args[2]
    if any(user.op == "output" for user in fx_y.users) or not isinstance(getattr(buf, "data", None), ir.StorageBox):
        return False  # a y that is also a carry must not alias the ys buffer
    base = buf.data.data
    node, y_layout = _extern_output_of(y)
    if node is None or not isinstance(base, ir.InputBuffer) or base.get_name() in node.get_read_names():
        return False
    blay, lay, sv = base.layout, node.layout, V.graph.sizevars
    size, stride = list(blay.size[1:]), list(blay.stride[1:])

    def equal(a, b):
        return len(a) == len(b) and all(sv.statically_known_equals(p, q) for p, q in zip(a, b))

    dense = ir.FlexibleLayout.contiguous_strides
    if not (lay.dtype == blay.dtype and lay.device == blay.device
            and equal(y_layout.size, size) and equal(y_layout.stride, stride)
            and sv.statically_known_equals(y_layout.offset, 0) and sv.statically_known_equals(lay.offset, 0)
            and equal(stride, dense(size)) and equal(lay.stride, dense(lay.size))):
        return False  # y is not the kernel's whole output, dense, in the row's layout
    offset = blay.offset + sympy.sympify(i) * blay.stride[0]
    row = ir.ReinterpretView(data=buf.data, layout=ir.FixedLayout(blay.device, blay.dtype, list(lay.size),
                                                                   list(lay.stride), offset))
    node.layout = ir.NonOwningLayout(row)
    V.graph.never_reuse_buffers.add(node.get_name())  # its storage is the row: never handed on
    V.graph.mark_buffer_mutated(base.get_name())
    _also_uses_symbols_of(node, offset)
    return True


def _extern_output_of(y):
    """``(extern kernel node, y's layout)`` when ``y`` is (a view of) the output
    of a plain extern kernel call whose layout is still its own (fixed or
    flexible, not yet aliased elsewhere), else ``(None, None)``."""
    from torch._inductor import ir

    data = getattr(y, "data", None)
    if isinstance(data, ir.BaseView):
        try:
            view = ir.ExternKernel.convert_to_reinterpret_view(data)
        except Exception:  # not strides over one buffer
            return None, None
        box, layout = view.data, view.layout
    else:
        box, layout = data, None
    node = box.data if isinstance(box, ir.StorageBox) else None
    if type(node) is not ir.ExternKernelOut or type(node.layout) not in (ir.FixedLayout, ir.FlexibleLayout):
        return None, None
    return node, layout or node.layout


def _also_uses_symbols_of(node, expr):
    """The kernel now writes at an offset of the loop index (an unbacked
    symbol): the scheduler must place it after the index is read, and it only
    orders kernels by the symbols of their inputs."""
    from torch._inductor.utils import get_free_symbols

    if not get_free_symbols(expr, unbacked_only=True):
        return
    uses = node.get_free_symbol_uses

    def get_free_symbol_uses(unbacked_only=False):
        return uses(unbacked_only) | get_free_symbols(expr, unbacked_only)

    node.get_free_symbol_uses = get_free_symbol_uses


def _allocate_no_input_buffers():
    """torch 2.9's wrapper allocates the base of a ``NonOwningLayout`` view
    before aliasing it, also when that base is a graph input (a fresh
    ``empty_strided`` shadowing the input): skip input buffers, as torch 2.14's
    ``PythonWrapperCodegen.codegen_allocation`` does. Idempotent."""
    from torch._inductor import ir
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    allocate = PythonWrapperCodegen.codegen_allocation
    if getattr(allocate, "_scan_skips_inputs", False):
        return

    def codegen_allocation(self, buffer):
        if isinstance(buffer, ir.InputBuffer):
            return None
        return allocate(self, buffer)

    codegen_allocation._scan_skips_inputs = True
    PythonWrapperCodegen.codegen_allocation = codegen_allocation
