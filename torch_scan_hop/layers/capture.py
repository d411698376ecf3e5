"""transformers 5's output capture in a traced ``scan_layers``.

A transformers 5 model collects attentions, hidden states or router logits with forward
hooks on each layer and attention module (``_compat.transformers``): while it collects,
the loop runs every layer's hook, which appends that layer's output to the model's list.
A traced scan runs no hooks, so while a model collects, the body records what each
collecting hook would have been given (the hooked module's input and the output element
it reads) as extra ys, and after the scan those hooks are called once per layer, in
layer order, with that layer's row: the model's lists come out as the loop fills them.
Plain tuples throughout: under torch.compile all of this is traced by Dynamo.
"""
from .. import _compat
from ..core.trees import ScanError

HIDDEN_STATES = "hidden_states"  # the one key whose hook also reads the module's input (the initial state)


def capture_plan(layer, collected):
    """The capture hooks of ``layer``'s tree whose key the model collects now, as
    ``(prefix, hook, key, index)`` (prefix: the module's view prefix, "" for the layer,
    "attn." for a submodule), in a fixed order (the ys' order); None when there are none."""
    plan = []
    _add_captures(layer, "", collected, plan)
    return tuple(plan) or None


def _add_captures(module, prefix, collected, plan):
    for h in _compat.transformers.capture_hooks(module):
        key = _compat.transformers.capture_key(h)
        if key in collected:
            plan.append((prefix, h, key, _compat.transformers.capture_index(h)))
    for name, sub in _compat.nn.child_modules(module).items():
        if sub is not None:
            _add_captures(sub, prefix + name + ".", collected, plan)


class StepRecords:
    """What one step's collecting hooks would have been given: ``(first, value)`` per capture
    of the plan, (None, None) for a module the step did not call (its hook would not run)."""

    def __init__(self, plan):
        self.plan, self.got = plan, [None] * len(plan)

    def record(self, prefix, args, out):
        """The view at ``prefix`` returned ``out`` for ``args``: keep each collecting hook's inputs."""
        for pos, (where, _, key, index) in enumerate(self.plan):
            if where != prefix:
                continue
            if self.got[pos] is not None:
                raise ScanError(
                    f"scan_layers: module '{prefix[:-1] or 'the layer'}' of layer 0, whose output transformers is "
                    f"collecting ({key!r}), runs more than once per layer; a traced scan_layers records one "
                    "output per layer. Call the model without that output, or run the layers eagerly.")
            value = out[index] if isinstance(out, tuple) else out
            self.got[pos] = (args[0] if key == HIDDEN_STATES and args else None, value)

    def outputs(self):
        return tuple((None, None) if got is None else got for got in self.got)


def replay(layers, plan, stacked):
    """Call each collecting hook for every layer in order with that layer's row (``stacked``:
    the scan's ys of ``StepRecords.outputs``, stacked over the layers). The output is handed
    as a tuple with the recorded element at the hook's index, so the hook reads (and skips a
    None) exactly as in the loop; a hook whose module the body never called is not called.
    Each row is its own tensor, as the loop's outputs are, not a view of the stack: a user's
    in-place change of one stays in it, and a compiled graph returning them has no aliasing
    outputs (which AOTAutograd refuses once any input is a tensor subclass: FSDP2's DTensors)."""
    for i in range(len(layers)):
        for (_, hook, _, index), (first, value) in zip(plan, stacked):
            if first is None and value is None:
                continue
            row = None if value is None else value[i].clone()
            arg = None if first is None else first[i].clone()
            hook(layers[i], (arg,), (None,) * index + (row,))
