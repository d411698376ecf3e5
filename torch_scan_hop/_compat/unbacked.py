"""What tracing raises or records when a function depends on tensor values (torch 2.9-2.15):
a size from ``nonzero`` or a boolean mask, ``.item()``, ``.tolist()``, ``if t.sum() > 0``.
A scan body must be one graph of fixed shapes; these tell the callers when it is not."""


def data_dependence_errors():
    """What a trace raises when the traced function reads a tensor's value as a
    Python value (``if t.sum() > 0``, ``.item()``, ``bool(t)``)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, GuardOnDataDependentSymNode)


def first_value_dependent_node(gm):
    """The first node of ``gm`` whose value has a size (or is a scalar) known only from tensor
    values at run time: an unbacked symbol (``nonzero``, a boolean mask, ``.item()``,
    ``.tolist()``) that its inputs do not already carry. None if there is none."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    def unbacked(node):
        val = node.meta.get("val")
        try:
            return free_unbacked_symbols(val) if val is not None else set()
        except Exception:  # a value free_unbacked_symbols does not know: nothing to report
            return set()

    given = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        given |= unbacked(node)
    return next((n for n in gm.graph.nodes if n.op == "call_function" and unbacked(n) - given), None)


def is_data_dependence_error(e):
    """``data_dependence_errors``, or the C++ check an ATen kernel without symbolic sizes makes
    when handed an unbacked size (``split_with_sizes`` of a ``.tolist()``: an MoE router's per-expert
    token counts, which Dynamo captured as unbacked scalars)."""
    return isinstance(e, data_dependence_errors()) or (
        isinstance(e, RuntimeError) and "expected to contain only concrete integers" in str(e))
