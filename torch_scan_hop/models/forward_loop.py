"""Reading a model's forward: is its loop over the layers exactly ``h = layer(h, ...)``?

``scan_model`` runs the layers as scans without editing the model's code: while the model's
forward runs, its layer container hands out stand-ins that record each call and run the
whole stack when the last layer is called (``models.deferred``). That is the loop's result
only if the loop does nothing else with the hidden state: no hidden states collected by hand
(transformers 4's ``all_hidden_states += (hidden_states,)``), no change between layers, no
break. So the forward's source is parsed (``ast``, structure, not text) and the loop must be

    for layer in self.<layers>[...]:                 # or: for i, layer in enumerate(...)
        h = layer(h, <arguments that do not read h>)

with one such loop over the container. Anything else is a ScanError naming the model, the
line and what the loop does, never a scan that computes something else.
"""
import ast
import inspect
import textwrap

from ..core.trees import ScanError


class LoopShape:
    """What the check found: the container's attribute name and the hidden state's variable."""

    def __init__(self, container, hidden, line):
        self.container, self.hidden, self.line = container, hidden, line


def layer_loop(model_cls, candidates):
    """The one loop of ``model_cls.forward`` over ``self.<name>`` for a ``name`` in ``candidates``
    (the model's ModuleList attributes), checked to be ``h = layer(h, ...)``.

    Raises:
        ScanError: no such loop, several, or a loop that does more than call the layer.
    """
    family = model_cls.__name__
    fn = inspect.unwrap(model_cls.forward)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as e:
        raise ScanError(f"scan_model: cannot read {family}.forward's source ({e}); scan_model reads the "
                        "model's loop over its layers to check that a scan computes the same.") from None
    first_line = fn.__code__.co_firstlineno
    loops = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.For)
             and _container_of(node.iter) in candidates]
    if not loops:
        raise ScanError(f"scan_model: {family}.forward has no loop over its layers "
                        f"(self.{' / self.'.join(sorted(candidates)) or '<a ModuleList>'}); scan_model scans models "
                        "whose forward runs `for layer in self.layers: hidden = layer(hidden, ...)`.")
    if len(loops) > 1:
        raise ScanError(f"scan_model: {family}.forward loops over its layers {len(loops)} times (lines "
                        f"{', '.join(str(first_line + n.lineno - 1) for n in loops)}); scan_model scans one loop.")
    loop = loops[0]
    line = first_line + loop.lineno - 1
    layer = _layer_variable(loop, family, line)
    hidden = _hidden_variable(loop, layer, family, line)
    return LoopShape(_container_of(loop.iter), hidden, line)


def _container_of(node):
    """``name`` for ``self.name``, ``self.name[...]``, ``enumerate(self.name[...])``; else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate" \
            and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _layer_variable(loop, family, line):
    target, enumerated = loop.target, isinstance(loop.iter, ast.Call)
    if enumerated and isinstance(target, ast.Tuple) and len(target.elts) == 2:
        target = target.elts[1]
    if not isinstance(target, ast.Name) or (enumerated and target is loop.target):
        raise ScanError(f"scan_model: {family}.forward's loop over its layers (line {line}) does not bind each "
                        "layer to a name (`for layer in ...` or `for i, layer in enumerate(...)`).")
    return target.id


def _hidden_variable(loop, layer, family, line):
    body = loop.body
    call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Assign) else None
    ok = (not loop.orelse and call is not None and len(body[0].targets) == 1
          and isinstance(body[0].targets[0], ast.Name) and isinstance(call, ast.Call)
          and isinstance(call.func, ast.Name) and call.func.id == layer and call.args
          and isinstance(call.args[0], ast.Name) and call.args[0].id == body[0].targets[0].id)
    if not ok:
        what = "; ".join(ast.unparse(stmt).splitlines()[0] for stmt in body)
        raise ScanError(f"scan_model: {family}.forward's loop over its layers (line {line}) does more than "
                        f"`hidden = layer(hidden, ...)`: {what!r}. Scanning the layers would change what it "
                        "computes; scan the layers with scan_layers inside your own forward instead.")
    hidden = call.args[0].id
    rest = call.args[1:] + [k.value for k in call.keywords]
    if any(isinstance(n, ast.Name) and n.id == hidden for arg in rest for n in ast.walk(arg)):
        raise ScanError(f"scan_model: {family}.forward's loop (line {line}) passes the hidden state "
                        f"{hidden!r} to its layers twice; scan_model carries it as the layers' first input only.")
    return hidden
