"""The scan HigherOrderOperator itself (its rules live beside it, one module per rule).

Positional convention is upstream torch's own scan HOP, so upstream's Dynamo
tracer, front end and inductor pass all run on this object:

    scan_op(combine_fn, init: list, xs: list, additional_inputs: tuple)
        -> [*final_carry, *ys]

with ``combine_fn(*carry, *x_slice, *additional_inputs) -> [*new_carry, *y]``.
Keyword-only extras: ``remat`` is consumed by the autograd rule and never
reaches a graph; ``unroll`` becomes the loop schedule of ``core.schedule`` (one
node per segment, block bodies); ``reverse`` stays a ``reverse=True`` kwarg for
compilers (inductor lowers it in place), and becomes upstream's kwarg-free form
for ``torch.export`` (a scan over the indices L-1..0) and torch_xla's bridge
(flips around the node).
"""
import torch

from .. import _compat
from ..core import modes, route
from ..core.checks import input_name, mutation_message
from ..core.op_args import example_args
from ..core.trees import ScanError


class ScanOp(_compat.HigherOrderOperator):
    def __init__(self):
        super().__init__("scan")

    def __call__(self, combine_fn, init, xs, additional_inputs, *, reverse=False,
                 remat="save_all", unroll=1):
        if not isinstance(additional_inputs, (tuple, list)):
            raise TypeError(f"scan_op: additional_inputs must be a tuple, got {type(additional_inputs)}")
        if not xs:
            raise ValueError("scan_op: xs must have at least one tensor (it carries the length)")
        flat = [*init, *xs, *additional_inputs]
        subclass_rule = _subclass_rule(flat)
        if subclass_rule is not None:
            return subclass_rule(combine_fn, list(init), list(xs), tuple(additional_inputs),
                                 reverse=reverse, remat=remat, unroll=unroll)
        if modes.only_user_modes_active():
            if route.runs_the_loop(flat):  # remat: the loop below takes a partition function as save_all
                return _loop_under_user_modes(combine_fn, init, xs, additional_inputs, reverse, remat)
        kwargs = {}
        if reverse:
            kwargs["reverse"] = True
        if remat != "save_all":
            kwargs["remat"] = remat
        if unroll != 1:
            kwargs["unroll"] = unroll
        args = (combine_fn, list(init), list(xs), tuple(additional_inputs))
        if any(isinstance(a, (list, tuple, dict)) for a in flat):  # not the op's flat form: torch's own pytree walk
            return super().__call__(*args, **kwargs)
        return _compat.dispatch_flat(self, [combine_fn, *flat, *kwargs.values()], args, kwargs)

    def gen_schema(self, combine_fn, init, xs, additional_inputs, **kwargs):
        """The FunctionSchema of one call (HOP schemas depend on the body):
        flat tensor arguments, the body as a graph, the options keyword-only.
        Rejects a body that mutates its inputs, as the op's rules do."""
        init, xs, additional_inputs = list(init), list(xs), tuple(additional_inputs)
        gm = combine_fn if isinstance(combine_fn, torch.fx.GraphModule) else \
            _compat.materialize_as_graph(combine_fn, tuple(example_args(init, xs, additional_inputs)))
        mutated, outputs = _compat.input_mutations_and_outputs(gm)
        if mutated:
            raise ScanError(mutation_message(", ".join(input_name(i, len(init), len(xs)) for i in sorted(mutated))))
        return _scan_schema(self, combine_fn, gm, outputs, init, xs, additional_inputs, kwargs)


scan_op = ScanOp()

# Tensor subclass -> rule run BEFORE dispatch when the scan is traced (``op.dtensor``
# registers DTensor's). The Autograd key precedes the Python key where a subclass rule
# is found, and the traced autograd rule traces the body's joint with make_fx, which
# traces plain tensors only: a subclass must be unwrapped above autograd. In eager
# the op stays the loop over the subclass tensors themselves.
SUBCLASS_RULES = {}


def _subclass_rule(flat):
    if not SUBCLASS_RULES:
        return None
    for cls, rule in SUBCLASS_RULES.items():
        if any(isinstance(t, cls) for t in flat):
            return None if route.runs_the_loop(flat) else rule
    return None


def _scan_schema(op, combine_fn, gm, outputs, init, xs, additional_inputs, options):
    """torch's HopSchemaGenerator (``_compat.hop.schema_generator``) filled in for a scan call:
    ``gm`` is the body ``combine_fn`` as a graph, ``outputs`` its output values. torch 2.9 to
    2.15: the same add_arg / add_output / add_schema_tree_spec / gen_schema methods."""
    gen = _compat.hop.schema_generator(op)
    gen.add_arg("combine_fn", gm)
    for prefix, values in (("init", init), ("xs", xs), ("additional_input", additional_inputs)):
        for i, value in enumerate(values):
            gen.add_arg(f"{prefix}{i}", value)
    for name, value in options.items():  # a remat partition function is named, not embedded
        gen.add_arg(name, value if not callable(value) else getattr(value, "__name__", repr(value)), kw_only=True)
    for out in outputs:
        gen.add_output(out)
    gen.add_schema_tree_spec(combine_fn, init, xs, additional_inputs, **options)
    return gen.gen_schema()


def _loop_under_user_modes(combine_fn, init, xs, additional_inputs, reverse, remat):
    """Under modes that trace nothing (FlopCounterMode, selective checkpointing, a
    logging mode) on real tensors the op is the Python loop, called here before
    dispatch: the modes see each body op, as in a for loop, and no mode needs a
    rule for this op. A partition function (``remat`` callable) only picks what a
    traced backward saves; the loop's tape saves what each op saves."""
    from .loop import run_flat

    return run_flat(combine_fn, list(init), list(xs), tuple(additional_inputs), reverse,
                    "save_all" if callable(remat) else remat)
