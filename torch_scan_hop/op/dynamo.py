"""Dynamo: a VariableTracker that captures scan as ONE node with the body as a subgraph.

Dynamo picks the tracker for a HigherOrderOperator by name, so ours replaces
upstream's "scan" entry (our op IS torch.ops.higher_order.scan) and hands
upstream's own op object, if it ever shows up, to upstream's tracker. The
Dynamo internals it needs are wrapped, per torch version, in ``_compat``.

Our front end calls the op with ``functools.partial(pytree_step, ...)``: the
body takes flat leaves and returns ``[*carry_leaves, y]`` with ``y`` the user's
pytree. The subgraph's outputs are flattened (None leaves dropped) and the op's
flat result is unflattened back to ``[*carry_leaves, ys]`` for the front end,
so no Python-side state has to leave the speculated body. Tensors the body
closes over (and module parameters) become explicit additional inputs.
A graph break inside the body is a hard error naming the body.
"""
import re
import warnings

import torch

from .. import _compat
from .._compat import versions
from ..core import dtensors as dt
from ..core.checks import input_name, mutation_message
from ..remat.policies import RematPolicy, as_token
from ..trace.body_checks import is_leaf_write_error
from ..trace.flat_body import _ERROR, rewritten_step
from ..trace.graph import drop_dead_aliases
from ..trace.indexing import TensorIndexRewrite, rewrite_graph_indexing
from ..trace import example_values, same_branches
from . import carry_grads
from .carry_grads import example_of
from .compile_errors import GRAPH_BREAK, capture_failure, compile_error, tensor_repr_releases_its_guard


def _make_tracker_class():
    from .._compat import dynamo as dyn

    upstream_cls = dyn.tracker_registry()["scan"]
    uncaptured, unsupported = dyn.uncaptured_error_class(), dyn.unsupported_error_classes()

    class ScanVariable(dyn.tracker_base()):
        upstream = upstream_cls

        def _call_function(self, tx, args, kwargs):
            from .hop import scan_op

            if self.value is not scan_op:  # upstream's own op object: upstream's rules
                return self.upstream(self.value, self.source)._call_function(tx, args, kwargs)
            try:
                with tensor_repr_releases_its_guard():  # a failed fake run renders reprs
                    return self._call_ours(tx, args, kwargs)
            except Exception as e:
                failure = capture_failure(e, tx, uncaptured, unsupported)
                if failure is e:
                    raise
                raise failure from (None if isinstance(e, uncaptured) else e)

        @dyn.hard_error(reason=GRAPH_BREAK)
        def _call_ours(self, tx, args, kwargs):
            args, kwargs = dyn.realize_all((args, kwargs))
            if len(args) != 4:
                dyn.graph_break(f"scan: expected (combine_fn, init, xs, additional_inputs), got {len(args)} args")
            combine_fn, init, xs, additional = args
            _materialize_lazy_graph(combine_fn)
            options = {k: _option_value(tx, k, v) for k, v in kwargs.items()}
            options = _non_default_options(options)
            init_vars, xs_vars = init.unpack_var_sequence(tx), xs.unpack_var_sequence(tx)
            add_vars = additional.unpack_var_sequence(tx)
            _check_dtensor_sharded_sizes([("init", [example_of(v) for v in init_vars]),
                                          ("xs", [example_of(v) for v in xs_vars]),
                                          ("closure", [example_of(v) for v in add_vars])])
            body = _Body(combine_fn, len(init_vars), len(xs_vars))
            versions = _outer_versions(tx)
            (_, spec), graph, freevars = carry_grads.speculate(tx, body, init_vars, xs_vars, add_vars, self.value)
            _drop_unread_freevars(graph, freevars)
            _refuse_missed_writes(versions, len(init_vars), len(xs_vars), len(add_vars), freevars)
            _check_dtensor_sharded_sizes([("closure", [p.node.meta.get("example_value") for p in freevars])])
            _reject_constant_ys(spec)
            same_branches.inline_identical_conds(graph, lambda name: dyn.installed_subgraph(tx, name))
            rewrite_graph_indexing(graph)
            _clone_outputs_that_are_inputs(graph)
            _allow_scalar_outputs(tx)
            name = tx.output.install_subgraph("scan_body", dyn.subgraph_module(tx, graph))
            p_args = (dyn.make_attr(tx, name), init.as_proxy(), xs.as_proxy(),
                      tuple(additional.as_proxy()) + tuple(freevars.keys()))
            with example_values.asking():  # the node's example value: no autograd plan for it
                return dyn.call_and_unflatten(tx, self.value, p_args, options, spec)

    return ScanVariable


def _drop_unread_freevars(graph, freevars):
    """Closures the body reads only through dead aliases or detaches are not lifted (nor are those
    nodes kept), as on the make_fx route (``trace.graph``): the two routes then give XLA one
    program per training step (xla/eager.py). ``freevars``: outer proxy -> the body's placeholder."""
    _, orphans = drop_dead_aliases(graph)
    unread = {node for node in orphans if node.op == "placeholder"}
    for outer, inner in list(freevars.items()):
        if inner.node in unread:
            graph.erase_node(inner.node)
            del freevars[outer]


class _Body:
    """The body Dynamo speculates; one that writes into its carries in place is retried on copies
    of them (``flat_body.copied_carries``). A body that works as it is is traced as it is."""

    def __init__(self, fn, num_carry, num_x):
        self.fn, self.num_carry, self.num_x, self.copied = fn, num_carry, num_x, False

    def speculate(self, tx, sub_args, source_target):
        from .._compat import dynamo as dyn

        while True:
            before = _versions(sub_args[:self.num_carry])
            try:
                with TensorIndexRewrite(refresh_stale_reads=False):  # (rewrite_graph_indexing reads again)
                    out = dyn.speculate_subgraph(
                        tx, self.fn, sub_args, description="torch_scan_hop.scan body",
                        source_target=source_target, set_subgraph_inputs=_inputs_mode(sub_args),
                        should_flatten_outputs=True, supports_input_mutation=False, supports_aliasing=True)
                if self.copied or _versions(sub_args[:self.num_carry]) == before:
                    return out
                self._copy()  # a write Dynamo's own check missed: into a vmapped carry's batched value
                continue
            except Exception as e:
                names = _input_names(sub_args)
                mutated = _mutated_inputs(e, names) or ([0] if is_leaf_write_error(e) else [])
                if self.copied or not mutated or any(i >= self.num_carry for i in mutated):
                    _raise_if_input_mutation(e, self.num_carry, self.num_x, names)
                    raise
                self._copy()

    def _copy(self):
        from .._compat import dynamo as dyn

        self.copied = True
        self.fn = dyn.partial_tracker(rewritten_step, [dyn.constant(self.num_carry), self.fn])


def _unwrapped_version(e):
    """The version counter of a tensor below any functorch wrapper, None for a non-tensor."""
    e = _compat.below_functorch_wrappers(e)
    return e._version if isinstance(e, torch.Tensor) else None


def _outer_versions(tx):
    """{node: version below functorch wrappers} of the example values of the graphs the scan is
    traced in, before its body is speculated (``_refuse_missed_writes``)."""
    from .._compat import dynamo as dyn

    return {node: _unwrapped_version(node.meta.get("example_value"))
            for graph in dyn.tracer_graphs(tx) for node in graph.nodes}


def _refuse_missed_writes(versions, num_carry, num_x, num_add, freevars):
    """Dynamo compares its placeholders' own version counters: a write into a vmapped closed-over
    tensor bumps the batched value's only, which Dynamo misses. Refused here, as Dynamo's own check
    refuses the others: later, under AOTAutograd's trace of the graph's vmap levels, torch 2.9's
    cleanup of those levels masks the ScanError with an internal assert ("!dynamicLayerStack.empty()",
    fuzz seed 20000). ``versions``: ``_outer_versions`` before the speculation."""
    names = [input_name(num_carry + num_x + num_add + k, num_carry, num_x) for k, outer in enumerate(freevars)
             if outer.node in versions
             and versions[outer.node] != _unwrapped_version(outer.node.meta.get("example_value"))]
    if names:
        raise compile_error(mutation_message(", ".join(names)))


def _inputs_mode(sub_args):
    """How the speculation makes the body's placeholders. Our arguments are flat: with every one
    a tensor in the graph, "manual" makes one placeholder each, as "flatten_manual" does after
    Dynamo inlined ``tree_flatten`` and ``tree_unflatten`` over them, a third of a small body's
    speculation. Anything else (a constant leaf: "manual" would give it a placeholder of its
    own) takes "flatten_manual"."""
    tensors = all(isinstance(example_of(v), torch.Tensor) for v in sub_args)
    return "manual" if tensors else "flatten_manual"


def _versions(carry_vars):
    """The version counters of the carries' example values, below any functorch wrapper (a write into a
    vmapped carry bumps its batched value's counter only)."""
    return [_unwrapped_version(example_of(var)) for var in carry_vars]


def _input_names(sub_args):
    """The names the body's placeholders get: the arguments' own node names with "manual" inputs,
    "child", "child_1", ... after Dynamo's inlined ``tree_unflatten`` ("flatten_manual")."""
    if _inputs_mode(sub_args) == "manual":
        return [v.as_proxy().node.name for v in sub_args]
    return None


def _mutated_inputs(e, arg_names=None):
    """Positions of the subgraph inputs (flattened carries, x slices, closures) Dynamo found written
    into, read from its message: "Input mutation detected at [child_2] in graph(): ..." lists the
    mutated placeholders by name, then the graph, whose placeholders come first, in order (their
    names are not positions: child, child_1 may be taken by the enclosing graph). Without the
    graph: by ``arg_names`` (``_input_names``), else as "child" names' positions."""
    text = f"{e} {getattr(e, 'msg', '')}"
    found = re.search(r"[Ii]nput mutation detected at \[([^\]]*)\]", text)
    if found is None:
        return []
    placeholders = list(dict.fromkeys(re.findall(r"placeholder\[target=([^\]]+)\]", text[found.end():])))
    names = [n.strip() for n in found.group(1).split(",")]
    if not placeholders and arg_names is not None:  # no graph in the message: the arguments' names
        return [arg_names.index(n) if n in arg_names else 10 ** 9 for n in names]
    if not placeholders:  # no graph in the message: the default names are positions
        parsed = [re.fullmatch(r"child(?:_(\d+))?", n) for n in names]
        return [int(m.group(1) or 0) if m else 10 ** 9 for m in parsed]
    return [placeholders.index(n) if n in placeholders else 10 ** 9 for n in names]


def _raise_if_input_mutation(e, num_carry, num_x, arg_names=None):
    """Dynamo refuses a body that writes into an input with its own generic message ("Input mutation
    detected at [child_1]"); the ScanError names the leaf, as make_fx's check does."""
    mutated = _mutated_inputs(e, arg_names)
    if mutated:
        names = [input_name(i, num_carry, num_x) if i < 10 ** 9 else "a closed-over tensor" for i in mutated]
        raise compile_error(mutation_message(", ".join(dict.fromkeys(names)))) from e


def _check_dtensor_sharded_sizes(groups):
    """A DTensor may have dynamic sizes except along a dim it is sharded along. There, uneven
    shards give the ranks different graphs: a rank whose local size is 1 gets it specialized
    while another's stays symbolic, and functorch's partitioner then recomputes a collective
    in one rank's backward and saves it in the other's, a deadlock (torch 2.15, found by the
    random DTensor programs). Whether a global size is dynamic is the same on every rank, so
    every rank refuses alike, naming the leaf. ``groups``: (kind, example values)."""
    for kind, values in groups:
        for i, value in enumerate(values):
            if not dt.is_dtensor(value):
                continue
            dims = [d for d in dt.sharded_dims(value) if not isinstance(value.shape[d], int)]
            if dims:
                raise compile_error(
                    f"scan: {kind} leaf {i} ({dt.describe(value)}, shape {tuple(value.shape)}) has a dynamic "
                    f"size along dim {dims[0]}, which it is sharded along; a compiled scan over DTensors takes "
                    "dynamic sizes only along dims that are not sharded (uneven shards would give the ranks "
                    "different graphs). Compile with torch.compile(..., dynamic=False), or with the default "
                    "dynamic=None when only unsharded dims change (dynamic=True makes every size dynamic).")


def _clone_outputs_that_are_inputs(graph):
    """A body may return its input (``y = c``), as in eager; the op's subgraph
    must not alias, so such outputs get a clone."""
    out = graph.find_nodes(op="output")[0]
    (values,) = out.args
    with graph.inserting_before(out):
        values = [graph.call_method("clone", (v,)) if isinstance(v, torch.fx.Node) and v.op == "placeholder"
                  else v for v in values]
    out.args = (tuple(values),)
    graph.lint()


def _materialize_lazy_graph(fn_var):
    """A body that is a lazily compiled GraphModule (compiled autograd's backward
    graphs, re-traced graphs) must get its real forward before Dynamo inlines it:
    Dynamo skips ``_LazyGraphModule._lazy_forward``."""
    gm = getattr(fn_var, "value", None)
    if isinstance(gm, torch.fx.GraphModule) and hasattr(gm, "real_recompile"):
        gm.real_recompile()


def _allow_scalar_outputs(tx):
    """Inductor rewrites scan into a while_loop that indexes with
    ``aten._local_scalar_dense`` (pytorch 153437); that needs this frame's
    ShapeEnv to accept scalar outputs, which users should not have to set up."""
    _compat.allow_scalar_outputs(tx.output.shape_env)


def _non_default_options(options):
    """Defaults stay out of the graph, so it keeps upstream's kwarg-free form."""
    defaults = {"reverse": False, "remat": "save_all", "unroll": 1}
    return {k: v for k, v in options.items() if k not in defaults or v != defaults[k]}


def _reject_constant_ys(spec):
    """Only None may be a non-tensor leaf of y (as in eager)."""
    if not spec.masks_to_filter_const_values:
        return
    consts = [v for m, v in zip(spec.masks_to_filter_const_values, spec.const_values) if m]
    if consts[:1] == [_ERROR]:
        raise compile_error(consts[1])
    for value in consts:
        if value is not None:
            raise compile_error(f"scan: fn returned the non-tensor value {value!r} as a carry or y leaf; "
                                "leaves must be tensors (use torch.tensor(...)) or None.")


def _option_value(tx, name, var):
    """A keyword option as a Python value; a symbolic int (an int variable under
    dynamic=True, say unroll=k) is specialized, with a guard, to its value.
    Anything else must be a constant: a graph node cannot hold a function, so a
    callable ``remat`` works in eager and make_fx only."""
    from .._compat.dynamo import guard_identity, is_constant, is_symbolic_int

    if is_symbolic_int(var):
        return var.evaluate_expr(tx.output)
    if name == "remat" and isinstance(getattr(var, "value", None), RematPolicy):
        if not hasattr(var.value, "save"):  # Dynamo's stand-in for an object built while tracing
            raise compile_error("scan: a RematPolicy built inside the compiled function cannot be read by "
                                "torch.compile; build it outside (policy = RematPolicy(...)) and pass it in.")
        if getattr(var, "source", None) is not None:  # another policy object later: compile again
            try:
                guard_identity([var.source])
            except NotImplementedError:  # save_only_these_names(...) called while compiling: a constant
                pass
        return as_token(var.value)  # a policy stands in the graph as its token (a remat never changes values)
    if name == "remat" and not is_constant(var):
        raise compile_error(
            "scan: remat=<callable> is not supported under torch.compile (the compiled graph cannot hold a "
            "function); pass a policy name or RematPolicy, or call scan outside torch.compile.")
    return var.as_python_constant()


def install():
    """Register our tracker for the name "scan" (idempotent)."""
    from .._compat.dynamo import tracker_registry

    registry = tracker_registry()
    if getattr(registry["scan"], "_torch_scan_hop", False):
        return
    try:
        cls = _make_tracker_class()
    except (AttributeError, TypeError, ImportError) as e:  # a torch whose Dynamo internals moved
        warnings.warn(f"torch_scan_hop supports {versions.supported_range()}; on torch {torch.__version__} its "
                      f"torch.compile tracker could not be installed ({e}).")
        return
    cls._torch_scan_hop = True
    registry["scan"] = cls

