"""What tracing raises or records when a function depends on tensor values (torch 2.9 to 2.15):
a size from ``nonzero`` or a boolean mask, ``.item()``, ``.tolist()``, ``if t.sum() > 0``.
A scan body must be one graph of fixed shapes; these tell the callers when it is not."""


def first_value_dependent_node(gm):
    """The first node of ``gm`` that introduces a size or scalar known only from tensor values at
    run time (``nonzero``, a boolean mask, ``.item()``, ``.tolist()``): make_fx records the unbacked
    symbols a node binds in ``meta["unbacked_bindings"]`` (2.9 to 2.15). Read from there, not by
    walking the values' sizes: that walk changed what a later ``torch.export`` serialized."""
    return next((n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("unbacked_bindings")), None)


def is_data_dependence_error(e):
    """Did tracing a body fail because it depends on a tensor's values? What a trace raises for it
    (``if t.sum() > 0``, ``.item()``, ``bool(t)``); the C++ check an ATen kernel without symbolic
    sizes makes when handed an unbacked size (``split_with_sizes`` of a ``.tolist()``: an MoE
    router's per-expert token counts); and under Dynamo a UserError ("data-dependent expression")
    or, when the body made unbacked sizes that no output carries, PendingUnbackedSymbolNotFound
    once the scan's output is recorded (torch 2.9 to 2.15)."""
    from torch._dynamo.exc import UserError
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound

    if isinstance(e, (DataDependentOutputException, GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound)):
        return True
    if isinstance(e, UserError):
        return "data-dependent" in str(e)
    return isinstance(e, RuntimeError) and "expected to contain only concrete integers" in str(e)


def is_zero_here(n):
    """``n == 0`` for an int or a backed symbolic size, with a guard on that answer (a symbolic
    length whose example is 0 then compiles a no-step scan, and another length recompiles);
    False where the answer is known only at run time (an unbacked size). torch 2.9 to 2.15:
    ``torch.fx.experimental.symbolic_shapes.guard_or_false``."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(n == 0)
