"""Private-API mechanics of the torch 2.9 workarounds in ``inductor.workarounds``
(what each defect is, and why scan hits it, is documented there): inductor
IR patches and a FakeTensorMode rule. Each is a no-op where not needed; and one
defect of torch's tensor repr that a failed body capture under torch.func hits."""
import contextlib

import torch


def realize_copies_of_aliased_while_carries():
    """Make the copies ``WhileLoop._clone_aliased_inputs`` gives carries that share a
    buffer realized buffers. Idempotent; a no-op where they already are (torch 2.14).
    torch 2.9 to 2.15: ``ir.WhileLoop._clone_aliased_inputs(carried)`` (a staticmethod),
    ``ir.ExternKernel.copy_input``, ``ir.is_storage_and_layout``."""
    from torch._inductor import ir

    clone_aliased = ir.WhileLoop._clone_aliased_inputs
    if getattr(clone_aliased, "_scan_realized", False):
        return

    def clone_aliased_inputs(carried_inputs):
        result = clone_aliased(carried_inputs)
        return [new if new is old or ir.is_storage_and_layout(new) else ir.ExternKernel.copy_input(old)
                for new, old in zip(result, carried_inputs)]

    clone_aliased_inputs._scan_realized = True
    ir.WhileLoop._clone_aliased_inputs = staticmethod(clone_aliased_inputs)


def _visit_while_outputs(tag, visit):
    """Wrap ``ir.WhileLoop.create`` so that ``visit(loop, output)`` runs for each output of each
    loop it makes; ``tag`` marks the wrapper, so a second call with the same tag is a no-op.
    torch 2.9 to 2.15: ``ir.WhileLoop.create`` is a classmethod returning the loop's
    ``MultiOutput``s, whose ``inputs[0]`` is the loop."""
    from torch._inductor import ir

    create = ir.WhileLoop.create.__func__
    if getattr(create, tag, False):
        return

    def create_visited(cls, *args, **kwargs):
        outputs = create(cls, *args, **kwargs)
        for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
            loop = out.inputs[0] if isinstance(out, ir.MultiOutput) else None
            if isinstance(loop, ir.WhileLoop):
                visit(loop, out)
        return outputs

    setattr(create_visited, tag, True)
    ir.WhileLoop.create = classmethod(create_visited)


def keep_while_carried_inputs_unreused():
    """Put the buffers a ``WhileLoop`` carries in (and their views' buffers) in
    ``V.graph.never_reuse_buffers``: a loop output is its carried input when the body
    returns that input unchanged, or runs no iteration, so that storage must not be
    handed on when the input's last use (the loop) is over. Idempotent.
    torch 2.9 to 2.15: a loop's ``carried_inputs`` are realized buffers or views,
    ``V.graph.never_reuse_buffers``."""
    from torch._inductor.virtualized import V

    def unreused(loop, _out):
        for inp in loop.carried_inputs or ():
            V.graph.never_reuse_buffers.add(inp.get_name())

    _visit_while_outputs("_scan_unreused", unreused)


def mark_while_outputs_unaligned(ours):
    """Put the outputs of the ``WhileLoop``s whose body subgraph's name ``ours(name)`` accepts
    in ``V.graph.unaligned_buffers``: the wrapper then asserts no alignment for them, and the
    kernels that read them assume none. Idempotent. torch 2.9 to 2.15:
    ``WhileLoop.body_subgraph.name``, ``V.graph.unaligned_buffers`` (read by
    ``codegen_alignment_asserts``)."""
    from torch._inductor.virtualized import V

    def unaligned(loop, out):
        if ours(loop.body_subgraph.name):
            V.graph.unaligned_buffers.add(out.get_name())

    _visit_while_outputs("_scan_unaligned", unaligned)


def pair_while_mutations_by_index():
    """Give ``WhileLoop.create`` the carries its body mutates in index order. Idempotent.
    torch 2.9-2.11's ``create`` pairs each mutated carry with its output by walking that
    list in order; from 2.10 on ``check_input_alias_and_mutation`` lists them in the order
    the body's ops write them (2.9 sorted them), so a body writing carry 1 before carry 0
    gave output 1 carry 0's buffer (2.11: a scan's ys came back as its loop counter).
    torch 2.15 takes ``all_inputs[idx]`` itself. Sorting is what 2.9 returned. torch 2.9 to 2.15:
    ``torch._higher_order_ops.utils.check_input_alias_and_mutation(gm, fake_args)`` (maps,
    mutated indices), imported by ``ir.WhileLoop.create`` when it runs."""
    import torch._higher_order_ops.utils as hop_utils
    from torch._inductor import ir

    create = ir.WhileLoop.create.__func__
    if getattr(create, "_scan_sorted", False):
        return

    def create_sorted(cls, *args, **kwargs):
        check = hop_utils.check_input_alias_and_mutation

        def sorted_check(*a, **k):
            *maps, mutated = check(*a, **k)
            return (*maps, sorted(set(mutated)))

        hop_utils.check_input_alias_and_mutation = sorted_check
        try:
            return create(cls, *args, **kwargs)
        finally:
            hop_utils.check_input_alias_and_mutation = check

    create_sorted._scan_sorted = True
    ir.WhileLoop.create = classmethod(create_sorted)


def add_fake_rule(name, op, applies, adjust):
    """Under FakeTensorMode, for calls of ``op`` where ``applies(args, kwargs)``: run its
    meta kernel, then return ``adjust(meta_outputs, args, kwargs)`` (meta tensors) as
    fakes on the inputs' device. Once per ``name``; clears the fake dispatch cache
    (results cached before may be stale). torch 2.9 to 2.15:
    ``fake_impls.op_implementations_checks`` (consulted before meta kernels),
    ``fake_tensor.in_kernel_invocation_manager``, ``FakeTensor(mode, meta, device)``,
    ``FakeTensorMode.cache_clear``."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import (
        FakeTensor,
        FakeTensorMode,
        in_kernel_invocation_manager,
    )

    if any(getattr(rule, "_scan_rule", None) == name for _, rule in fake_impls.op_implementations_checks):
        return

    def rule(fake_mode, func, *args, **kwargs):
        if not applies(args, kwargs):
            return NotImplemented
        device = next(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
        with in_kernel_invocation_manager(fake_mode):
            outs = adjust(func(*args, **kwargs), args, kwargs)
        return tuple(FakeTensor(fake_mode, t, device) for t in outs)

    rule._scan_rule = name
    fake_impls.op_implementations_checks.append((lambda func: func is op, rule))
    FakeTensorMode.cache_clear()


@contextlib.contextmanager
def tensor_repr_releases_its_guard():
    """Within this block a tensor's repr that raises leaves functorch's keys as they were.

    torch's ``_tensor_str._str`` holds a ``_DisableFuncTorch`` guard in a local variable. When
    the repr raises, the exception's traceback keeps that frame, and with it the guard, alive;
    when the garbage collector frees it, later and at no fixed point, its destructor restores
    the dispatch-key state of the moment it was made: functorch's and autograd's keys excluded
    for the rest of the process. A scan body that Dynamo fails to run on fake tensors under
    ``vmap(jacfwd(...))`` gets such a repr: fake tensor validation renders the failing call, and
    the repr of a dual tensor there raises (torch's own ``_fw_primal`` assert). Every
    ``torch.func`` transform after it then failed ("Cannot access storage of TensorWrapper",
    internal asserts in ``_make_dual``). Here the guard is dropped as the repr returns or raises.
    torch 2.9 to 2.15: ``_tensor_str._str(self, *, tensor_contents)`` = no_grad + modes disabled +
    the guard around ``_str_intern``; ``Tensor.__repr__`` looks ``_str`` up on the module."""
    from torch import _tensor_str

    original = _tensor_str._str
    intern = getattr(_tensor_str, "_str_intern", None)
    if intern is None or getattr(original, "_releases_guard", False):
        yield
        return

    def _str(self, *, tensor_contents=None):
        with torch.no_grad(), torch.utils._python_dispatch._disable_current_modes():
            guard = torch._C._DisableFuncTorch()
            try:
                return intern(self, tensor_contents=tensor_contents)
            finally:
                del guard

    _str._releases_guard = True
    _tensor_str._str = _str
    try:
        yield
    finally:
        _tensor_str._str = original
