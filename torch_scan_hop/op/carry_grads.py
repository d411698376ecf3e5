"""The carries' requires-grad flags Dynamo speculates a scan body with, in as few speculations as possible.

In the loop, a carry requires grad at step k iff the body's output did at step k-1
(init's flag at step 1). The body is traced once for all steps, with the flags of
the least fixed point from init's: a carry requires grad if it does at any step,
so that what reads requires_grad at trace time (an autograd.Function's
``ctx.needs_input_grad``, ``t.requires_grad`` in the body) sees what the loop's later
steps see. Found by iteration, each round a speculation of the body by Dynamo:
the usual training body (init zeros, a trained weight read in the body) took two,
and a speculation is the costly part of a capture (a fifth of xla_compile.py's
training first call on eager XLA, ~0.1 s for its RNN cell).

So a frame that may train speculates a guess first: every floating carry
requires grad. It is kept only when the speculated graph proves it the least
fixed point (``_least_fixed_point``): the graph must not depend on the guess
(no read of a guessed carry's flags, or of anything computed from one, while
tracing), and a fake run of that graph from init's flags must reach every
guessed flag. Otherwise the iteration runs as before, from init's flags (or
from the least fixed point the graph gave, where it could), a speculation it
already made reused: a wrong guess costs one speculation, a guess right but
not provable none.
"""
import builtins
import types

import torch

from .. import _compat
from ..core import grad_reach


def speculate(tx, body, init_vars, xs_vars, add_vars, source_target):
    """``body.speculate``'s result, ``((output, spec), graph, freevars)``, traced with the carries
    requiring grad as in the loop's least fixed point."""
    from .._compat import dynamo as dyn
    from ..core.op_args import slice_example

    n = len(init_vars)

    def attempt(flags):
        with dyn.discard_graph_changes(tx):
            sub_args = [v.call_method(tx, "clone", args=(), kwargs={}) for v in init_vars]
            sub_args += [dyn.inlined(tx, slice_example)(v) for v in xs_vars]
            sub_args += [v.call_method(tx, "clone", args=(), kwargs={}) for v in add_vars]
        _require_grad(sub_args[:n], flags)
        return body.speculate(tx, sub_args, source_target)

    init_flags = [isinstance(e, torch.Tensor) and e.requires_grad for e in map(example_of, init_vars)]
    flags, made = init_flags, {}
    guess = _guess(tx, init_vars, xs_vars, add_vars, init_flags)
    if guess != init_flags:
        outer = dyn.tracer_graphs(tx)
        with dyn.flag_reads() as reads:
            made[tuple(guess)] = out = attempt(guess)
        least = _least_fixed_point(tx, out[1], init_flags, guess, reads, outer)
        if least == guess:
            return out
        flags = least or init_flags
    for _ in range(n + 1):
        out = made.pop(tuple(flags), None) or attempt(flags)
        grown = carries_requiring_grad(out[1], flags)
        if grown == flags:
            break
        flags = grown
    return out


def _guess(tx, init_vars, xs_vars, add_vars, init_flags):
    """Every floating carry requires grad, where the frame may train (grad mode on and a
    tensor it reaches requires grad); else init's flags (no guess). A carry a torch.func
    transform wraps keeps init's flag (``_require_grad`` leaves it)."""
    from .._compat import dynamo as dyn

    if not torch.is_grad_enabled():
        return init_flags
    examples = [example_of(v) for v in (*init_vars, *xs_vars, *add_vars)]
    placeholders = [p.meta.get("example_value") for g in dyn.tracer_graphs(tx) for p in g.find_nodes(op="placeholder")]
    if not (_any_requires_grad(examples + placeholders)
            or grad_reach.reaches_grad(dyn.frame_locals(tx).values(), 2)):
        return init_flags
    guess = []
    for flag, e in zip(init_flags, examples):
        floating = isinstance(e, torch.Tensor) and (e.is_floating_point() or e.is_complex())
        guess.append(flag or (floating and not _compat.is_functorch_wrapped(e)))
    return guess


def _any_requires_grad(values):
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _least_fixed_point(tx, graph, init_flags, guess, reads, outer_graphs):
    """The least fixed point from ``init_flags`` of the body ``graph`` traced under ``guess``,
    or None where the graph cannot tell it: the guess is not a fixed point, tracing read the
    flags (``reads``: the nodes whose requires_grad Dynamo read) of a guessed carry or of what
    is computed from one (the body could branch on them, so another guess could give another
    graph), or the graph holds what a fake run would not redo exactly (a subgraph, a module
    call, a Python function: ``_runnable``). Nodes of the enclosing graphs (``outer_graphs``)
    do not depend on the carries; those of any other graph (a nested body's) might."""
    if carries_requiring_grad(graph, guess) != guess:
        return None
    placeholders = list(graph.find_nodes(op="placeholder"))
    n = len(init_flags)
    dependents = _downstream(graph, {placeholders[i] for i in range(n) if guess[i] and not init_flags[i]})
    for node in reads:
        if node is None or node in dependents or not any(node.graph is g for g in [graph, *outer_graphs]):
            return None
    if not all(_runnable(node, dependents) for node in graph.nodes):
        return None
    flags = init_flags
    for _ in range(n + 1):
        outs = _fake_run(tx, graph, placeholders, flags)
        if outs is None:
            return None
        grown = [f or o for f, o in zip(flags, outs)]
        if grown == flags:
            return flags
        flags = grown
    return flags


def _downstream(graph, sources):
    found = set(sources)
    for node in graph.nodes:  # topological order
        if any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _runnable(node, dependents):
    """A node a fake run redoes as Dynamo's speculation did: an operator, a builtin (torch's C
    functions, ``operator``'s, ``_set_grad_enabled``) or a tensor method. ``getattr`` of a
    tensor computed from a guessed carry is refused (``t.is_leaf`` reads its flags)."""
    if node.op in ("placeholder", "output", "call_method"):
        return True
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return node not in dependents
    return isinstance(node.target, _OPERATORS)


_OPERATORS = (types.BuiltinFunctionType, type(torch.ops.aten.add.Tensor), type(torch.ops.aten.add))


def _fake_run(tx, graph, placeholders, flags):
    """The carry outputs' requires_grad when the graph runs on its example values with the
    carries requiring grad as ``flags`` say; None where the run fails."""
    from .._compat import dynamo as dyn

    env, grad_mode = {}, torch.is_grad_enabled()
    try:
        with _compat.disable_proxy_modes_tracing(), dyn.fake_mode(tx):
            for i, p in enumerate(placeholders):
                e = p.meta.get("example_value")
                if i < len(flags) and isinstance(e, torch.Tensor) and (flags[i] or e.requires_grad):
                    e = e.detach().requires_grad_(flags[i])
                env[p] = e
            for node in graph.nodes:
                if node.op == "output":
                    outs = node.args[0][:len(flags)]
                    return [isinstance(o, torch.fx.Node) and isinstance(env[o], torch.Tensor)
                            and env[o].requires_grad for o in outs]
                if node.op == "placeholder":
                    continue
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.op == "call_method":
                    env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    env[node] = node.target(*args, **kwargs)
    except Exception:
        return None
    finally:
        torch.set_grad_enabled(grad_mode)
    return None


def _require_grad(carry_vars, flags):
    """The carries' example values, made to require grad where ``flags`` says. The body is
    traced with a carry requiring grad when any step's does, as in the loop from step 2 on:
    what reads requires_grad at trace time (an autograd.Function's ``ctx.needs_input_grad``)
    must see it. A carry wrapped by a torch.func transform (Dynamo tracing ``grad(f)``) is
    left as it is: functorch refuses ``requires_grad_`` there and differentiates by its own
    levels. A carry no transform wraps is marked also while one is active (an unbatched carry
    of ``vmap(f)`` whose body applies a module with trained weights)."""
    with _compat.disable_proxy_modes_tracing(), _compat.functorch.requires_grad_allowed():
        for var, flag in zip(carry_vars, flags):
            e = example_of(var)
            if flag and not e.requires_grad and not _compat.is_functorch_wrapped(e):
                var.as_proxy().node.meta["example_value"] = e.detach().requires_grad_()


def carries_requiring_grad(graph, flags):
    """``flags`` grown by the body's carry outputs that require grad."""
    (outs,) = graph.find_nodes(op="output")[0].args
    grown = []
    for flag, out in zip(flags, outs[:len(flags)]):
        e = out.meta.get("example_value") if isinstance(out, torch.fx.Node) else None
        grown.append(flag or (isinstance(e, torch.Tensor) and e.requires_grad))
    return grown


def example_of(var):
    """The example value of a traced variable; None for one without a graph node (a constant)."""
    try:
        proxy = var.as_proxy()
    except (AttributeError, NotImplementedError):
        return None
    return proxy.node.meta.get("example_value") if isinstance(proxy, torch.fx.Proxy) else None
