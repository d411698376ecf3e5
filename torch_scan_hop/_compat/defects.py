"""Private-API mechanics of the torch 2.9 workarounds in ``inductor.workarounds``
(what each defect is, and why scan hits it, is documented there): an inductor
IR patch and a FakeTensorMode rule. Both are no-ops where not needed."""
import torch


def realize_copies_of_aliased_while_carries():
    """Make the copies ``WhileLoop._clone_aliased_inputs`` gives carries that share a
    buffer realized buffers. Idempotent; a no-op where they already are (torch 2.14).
    torch 2.9-2.14: ``ir.WhileLoop._clone_aliased_inputs(carried)`` (a staticmethod),
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


def add_fake_rule(name, op, applies, adjust):
    """Under FakeTensorMode, for calls of ``op`` where ``applies(args, kwargs)``: run its
    meta kernel, then return ``adjust(meta_outputs, args, kwargs)`` (meta tensors) as
    fakes on the inputs' device. Once per ``name``; clears the fake dispatch cache
    (results cached before may be stale). torch 2.9-2.14:
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
