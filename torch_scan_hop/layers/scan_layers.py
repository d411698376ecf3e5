"""``scan_layers``: a stack of identical modules run as ONE scan over their stacked weights.

In plain eager it is the loop itself, over the real layers (hooks included),
with ``remat`` as a per-layer checkpoint (with ``stack_layers(..., grads="stacked")``
and no hooks or running-stat updates, over the stacks' rows, so that autograd sees
the stacks). Traced (torch.compile, export, XLA),
the parameters and buffers of the layers are stacked (``layers.stack_weights``: a
stack whose gradient flows back to every layer's own ``.grad``) and scanned
over; the body calls the first layer's code on one layer's slice through a
read-only view (``layers.view``). The traced body therefore does not depend on
the depth: one trace, one compile, for 8 or 64 layers.

Layers must be identical up to their weights, in every mode: same type,
parameter and buffer names, shapes and dtypes, and the same plain attributes
(a scale, ``training``), since the traced body runs layer 0's code with layer
0's attributes. Broadcast keyword inputs (attention masks, positions) reach
every layer unchanged; tensor ones are closed over (constants of the call).
"""
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import _compat
from ..api import scan
from ..core import route, schedule
from ..remat.policies import Remat, as_policy
from ..core.torch_xla_keywords import remat_with_torch_xla_keywords
from ..core.trees import ScanError, flatten
from ..op.compile_errors import surface
from ..op.loop import remat_step
from .attributes import all_attributes_agree
from .capture import StepRecords, capture_plan, replay
from .checks import (
    check_no_hooks,
    check_no_hooks_traced,
    check_no_running_stat_updates,
    check_one_tuple_is_not_several_inputs,
    differentiates_stacks,
)
from .fsdp import check_fsdp, gathered_state, tensor_parallel_parts
from .grads import check_flags_traced, stacks_swapped
from .layer_state import check_sharded_alike, layer_state, layer_states
from . import alike, blocks, module_state, patterns, trace_time, written_rows
from .experts import check_experts_trace
from .layer_kwargs import split as split_kwargs
from .outputs import join_output, layer_name, split_output, stack_extras
from .ownership import container_of, container_token, owner_of
from .stack_weights import stack_state, stack_weights
from .storage import stacked_storage
from .view import view_of


def _resolve_unroll(unroll):
    """``unroll=None`` is 1 on every path and at every depth: on XLA the stack is ONE ``While``, so
    its HLO, compile time and compile memory do not grow with the depth (torch_xla's and JAX's
    contract for scan over layers; torch_xla's test_decoder_model asserts the ``while(`` for 8
    layers). Straight-line code (csrc/hlo_straight.h) is what ``unroll=len(layers)`` asks for: at
    depth 8 of benchmarks/xla_long.py it stepped 1.05x the loop against the While's 1.13-1.17x,
    but its HLO and compile grow with the stack, a price only the user can choose to pay."""
    return 1 if unroll is None else unroll


def _from_storage(layers, stacked, ref_state, token, trained_stacks):
    """The scanned weights from stacked storage: the stacked tensors themselves (no copy; their
    gradient is handed to the layers by ``layers.storage``, to those whose flag asks for it), detached
    for a parameter name no layer requires grad for. With ``trained_stacks`` (grads="stacked")
    the stacks are parameters with their own flag and gradient. Buffers (and Parameters the stacks leave
    out) are stacked per call as without stacked storage."""
    xs, buffer_names = {}, []
    for name in ref_state:
        if name not in stacked:
            buffer_names.append(name)
            continue
        P = stacked[name]
        xs[name] = P if trained_stacks or _some_layer_wants_grad(layers, name, token) else P.detach()
    if buffer_names:
        states = [layer_state(layer, "", {}) for layer in layers]
        for name in buffer_names:
            xs[name] = stack_weights([state[name] for state in states])
    return xs


def _some_layer_wants_grad(layers, name, token):
    """Any layer's ``requires_grad`` for ``name``. Under Dynamo it is first asked in Python
    when tracing, unguarded: a yes stays right whatever the flags do later (the gradient is
    handed out by each layer's current flag). Only a no is then read in traced code, one
    guard per layer, so unfreezing a layer recompiles. (Layer 0's flag alone, as before,
    gave no gradient to any layer once the first one was frozen.)"""
    if token is not None and _compat.is_dynamo_compiling() and _name_wants_grad_when_traced(token, name):
        return True
    return _any_requires_grad(layers, name)


@torch.compiler.assume_constant_result  # runs in Python when traced; the token is guarded, the result not
def _name_wants_grad_when_traced(token, name):
    return _any_requires_grad(list(container_of(token)), name)


def _any_requires_grad(layers, name):
    return any(m._parameters[leaf].requires_grad for m, leaf in layers_owners(layers, name))


def layers_owners(layers, name):
    return [owner_of(layer, name) for layer in layers]


def _as_output(inputs):
    return inputs[0] if len(inputs) == 1 else tuple(inputs)


def _eager_loop(layers, inputs, remat, per_layer):
    """The loop over the real layers (hooks and all), remat per layer; extras stacked.
    ``per_layer[i]``: layer i's keyword inputs."""
    n = len(inputs)
    h, extras = _as_output(inputs), []
    saves_all = as_policy(remat) is None  # the plain tape: each layer called as it is
    for i, layer in enumerate(layers):
        call = lambda h, layer=layer, kw=per_layer[i]: layer(*((h,) if n == 1 else h), **kw)  # noqa: E731
        h, extra = split_output(call(h) if saves_all else remat_step(call, remat)(h), h, n, layers, i)
        written_rows.settle(per_layer[i])
        extras.append(extra)
    return join_output(h, stack_extras(extras, layers), n)


def _check_call(layers, inputs, broadcast_kwargs, layer_kwargs):
    if not all(isinstance(m, torch.nn.Module) for m in layers):
        raise ScanError("scan_layers: every element of layers must be an nn.Module.")
    if not inputs:
        raise ScanError("scan_layers: pass the hidden state as a positional input: scan_layers(layers, x).")
    if layer_kwargs is not None:
        if len(layer_kwargs) != len(layers) or not all(isinstance(kw, dict) for kw in layer_kwargs):
            raise ScanError(f"scan_layers: layer_kwargs must be one dict of keyword inputs per layer ({len(layers)} "
                            f"layers), got {type(layer_kwargs).__name__} of {len(layer_kwargs)}.")
        for i, kw in enumerate(layer_kwargs):
            both = sorted(set(kw) & set(broadcast_kwargs))
            if both:
                raise ScanError(f"scan_layers: keyword {both[0]!r} is given both for every layer and in "
                                f"layer_kwargs[{i}]; pass it in one of them.")
    if layers:
        check_one_tuple_is_not_several_inputs(layers[0], inputs, broadcast_kwargs)


def _per_layer(layers, broadcast_kwargs, layer_kwargs):
    """Each layer's keyword inputs: the broadcast ones and its own."""
    if layer_kwargs is None:
        return [broadcast_kwargs] * len(layers)
    return [{**broadcast_kwargs, **kw} for kw in layer_kwargs]


def scan_layers(layers: Iterable[torch.nn.Module], *inputs: Any, remat: Remat = "save_all",
                unroll: int | None = None, partition_fn: Callable[..., Any] | None = None,
                is_layer_pure: bool | None = None,
                layer_kwargs: Sequence[dict[str, Any]] | None = None, period: int | str = 1,
                **broadcast_kwargs: Any) -> Any:
    """``for layer in layers: inputs = layer(*inputs, **broadcast_kwargs)`` as one scan.

    ``layers``: an ``nn.ModuleList`` (or sequence) of modules with identical
    structure. With one input the layers map a tensor (or pytree) to the same
    structure; with several, each layer takes them all and returns a tuple of
    the same structure. Returns what the last layer returns (the inputs for
    an empty stack). Gradients land on each layer's own parameters (on the stacks
    under ``stack_layers(layers, grads="stacked")``).

    A layer may also return a tuple whose first element (first ``n`` for ``n`` inputs) is
    the hidden state, followed by extras, as Hugging Face layers do (GPT2Block, BertLayer:
    ``(hidden_states, attn_weights, ...)``). The hidden state is carried to the next layer,
    and ``scan_layers`` returns the last layer's tuple with every extra stacked over the
    layers: ``None`` stays ``None``, a tensor (attention weights, router logits, an auxiliary
    loss) of shape ``S`` becomes one of shape ``(len(layers), *S)``. So
    ``h, attn = scan_layers(model.h, h, output_attentions=True)[:2]``; ``(h,) =
    scan_layers(model.h, h)`` for a layer returning ``(hidden_states,)``. Any other tuple
    is a ScanError naming the layer, what it returned and what it was given.

    ``unroll``: layers per loop iteration, as in ``scan``. ``None`` is 1 (one ``While`` on XLA at
    every depth); ``len(layers)`` runs straight-line, no ``While`` (``_resolve_unroll``).

    ``layer_kwargs``: one dict of keyword inputs per layer, beside the ``broadcast_kwargs`` every
    layer gets (``layers.layer_kwargs``): a leaf that is the same object for every layer is closed
    over, a tensor that differs is stacked and sliced per layer, a plain value that differs is a
    ScanError. ``period``: 1 (the default) for layers of one structure; ``p`` for a stack whose
    layers repeat a pattern of ``p`` kinds (Gemma 3's 5 sliding + 1 full attention: 6), run as ONE
    scan over blocks of ``p`` layers plus the layers left over, called as they are; ``"auto"``
    finds the pattern from the layers' types, weights and plain attributes (``layers.patterns``:
    runs of one kind become scans of their own). Patterns take one hidden-state input.

    ``partition_fn`` and ``is_layer_pure`` are torch_xla.experimental.scan_layers' keywords, taken
    here rather than passed to the layers: ``partition_fn`` is ``remat``, ``is_layer_pure`` is ignored
    (``core/torch_xla_keywords.py``).

    Args:
        layers: an ``nn.ModuleList`` (or sequence) of modules identical up to their weights.
        *inputs: the hidden state (a tensor or pytree), or several inputs every layer takes.
        remat: what the backward keeps per layer, as ``scan``'s ``remat``.
        unroll: layers per loop iteration (above).
        partition_fn: torch_xla's name for ``remat`` (give one of the two).
        is_layer_pure: torch_xla's cache flag: accepted, changes nothing.
        layer_kwargs: one dict of keyword inputs per layer (above).
        period: the length of the layers' repeating pattern, or "auto" (above).
        **broadcast_kwargs: keyword inputs every layer gets unchanged (tensors: no gradient).

    Returns:
        What the last layer returns (above): the hidden state, a tuple of them for several
        inputs, or the last layer's tuple with the extras stacked; the inputs for no layer.

    Raises:
        ScanError: layers that differ (naming layer and attribute), bad options, or, traced,
            module hooks and in-place running statistics.

    Example:
        >>> import torch
        >>> from torch_scan_hop import scan_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> h = scan_layers(layers, torch.randn(2, 8))  # for layer in layers: h = layer(h)
        >>> tuple(h.shape)
        (2, 8)
    """
    if period != 1:
        return scan_patterned(layers, *inputs, remat=remat, unroll=unroll, partition_fn=partition_fn,
                              is_layer_pure=is_layer_pure, layer_kwargs=layer_kwargs, period=period,
                              **broadcast_kwargs)
    container, layers = layers, list(layers)
    try:  # the checks of the call itself; under torch.compile their ScanError is surfaced as one
        remat = remat_with_torch_xla_keywords(remat, partition_fn, "is_layer_pure", is_layer_pure, "scan_layers")
        _check_call(layers, inputs, broadcast_kwargs, layer_kwargs)
        if not layers:
            return _as_output(inputs)
        per_layer = _per_layer(layers, broadcast_kwargs, layer_kwargs)
        # torch.export keeps the per-call stack: its program then lifts the layers' registered parameters
        stacked = None if _compat.is_exporting() else stacked_storage(container)
        # stacked storage was checked for identical structure when made: layer 0's state suffices here
        states = layer_states(layers) if stacked is None else [layer_state(layers[0], "", {})]
    except ScanError as e:
        surface(e)
    dynamo = _compat.is_dynamo_compiling()
    token = None if stacked is None else container_token(container)
    flat_inputs = [t for t in flatten((inputs, broadcast_kwargs, layer_kwargs))[0] if isinstance(t, torch.Tensor)]
    trained_stacks = stacked is not None and container.grads_mode == "stacked"
    over_rows = False  # eager, over the stacks' rows: hooks and running stats already ruled out
    tensors = flat_inputs + list(states[0].values())
    if (route.runs_the_loop(tensors, remat)
            and not stacks_swapped(container, stacked)):  # a swapped stack: scanned, the layers cannot run it
        # a layer's own attribute: its own code runs it
        over_rows = trained_stacks and differentiates_stacks(container, layers) and all_attributes_agree(layers)
        if not over_rows:
            return _eager_loop(layers, inputs, remat, per_layer)
    try:  # traced: the per-layer keywords split into shared ones and stacked rows
        per_layer, slots = written_rows.as_rows(per_layer)
        shared, varying = (broadcast_kwargs, None) if layer_kwargs is None else split_kwargs(
            per_layer, lambda i: layer_name(layers, i))
        if stacked is None:
            check_sharded_alike(states)
    except ScanError as e:
        surface(e)
    fsdp_meshes, tp_specs = check_fsdp(layers[0]), {}  # meshes None: not sharded by FSDP2
    if fsdp_meshes is not None and stacked is None:
        states, tp_specs = tensor_parallel_parts(states, fsdp_meshes)
    unroll = _resolve_unroll(unroll)
    # one iteration of every layer: no While on XLA (a bad unroll is scan's ScanError)
    straight = schedule.one_iteration(len(layers), unroll)
    template = layers[0]
    single = len(inputs) == 1
    plan = None  # the transformers capture hooks a model collects now: recorded by the body
    if not over_rows:
        try:  # Dynamo: read in traced code (a guard), the hooks themselves once (checks.check_no_hooks_traced)
            collected = check_no_hooks_traced(layers, token) if dynamo else check_no_hooks(layers)
            if dynamo:  # the experts' implementation traces (layers.experts), asked once, at trace time
                trace_time.ask(check_experts_trace, None, template, torch.is_grad_enabled(), True)
            else:
                check_experts_trace(template, torch.is_grad_enabled(), False)
        except ScanError as e:
            surface(e)
        plan = capture_plan(template, collected) if collected else None
    if not dynamo and not over_rows:  # checked here, in Python: the traced body then reads no peer
        check_no_running_stat_updates(template)  # other layers agree with layer 0 or are refused as read
    peers = () if over_rows or (not dynamo and all_attributes_agree(layers)) else layers[1:]
    selecting = written_rows.selecting_reads(template, slots[0])  # compared with no peer
    attrs = module_state.rows(template, layers)  # per-layer tensors kept on the modules
    # a scan over blocks: runs of one kind in the block as nested scans (layers.blocks)
    nest = blocks.nested_runs(layers, states, slots, attrs, plan, fsdp_meshes, straight)
    if nest is not None:
        xs = blocks.stack_nested(states, nest)
    else:
        xs = stack_state(states, straight) if stacked is None else _from_storage(
            layers, stacked, states[0], token, trained_stacks)

    def step(h, params_and_rows):
        params, rows, attr_rows = params_and_rows
        kwargs, writes = written_rows.at_step(shared if varying is None else varying.rebuild(rows), slots[0])
        if nest is not None:
            kwargs = {**kwargs, "runs": nest}
        if dynamo:  # in the body: under torch.compile only errors raised there stay ScanErrors
            check_no_running_stat_updates(template)
            if trained_stacks:
                check_flags_traced(container, token)
        args = (h,) if single else tuple(h)
        if fsdp_meshes is not None:  # FSDP2's unshard, for this step's layer (its gradient reduce-scattered back)
            params = gathered_state(params, fsdp_meshes, tp_specs)
        records = None if plan is None else StepRecords(plan)
        checked = dict(selecting)  # the view also records here what the body assigns
        out = view_of(template, {**params, **attr_rows}, peers=peers, checked=checked,
                      recorder=records)(*args, **kwargs)  # shared kwargs: closed over
        out, extras = split_output(out, h, len(inputs), layers, 0)  # extras: the scan's ys
        return out, (extras, None if records is None else records.outputs(), tuple(w.written() for w in writes),
                     module_state.written(checked))

    rows = [] if varying is None else varying.stacks()
    out, (extras, recorded, written, attr_ys) = scan(step, _as_output(inputs), (xs, rows, attrs), remat=remat,
                                                     unroll=unroll)
    if plan is not None:
        replay(layers, plan, recorded)
    written_rows.hand_back(slots, written)
    module_state.hand_back(layers, attr_ys)
    return join_output(out, extras, len(inputs))


def scan_patterned(layers, hidden, *, remat="save_all", unroll=None, partition_fn=None, is_layer_pure=None,
                   layer_kwargs=None, period="auto", **broadcast_kwargs):
    """``scan_layers(..., period=p or "auto")``: a patterned stack as scans over blocks and runs
    (``layers.patterns``), segment by segment in layer order; a single layer is called as it is."""
    container, layers = layers, list(layers)
    try:
        remat = remat_with_torch_xla_keywords(remat, partition_fn, "is_layer_pure", is_layer_pure, "scan_layers")
        _check_call(layers, (hidden,), broadcast_kwargs, layer_kwargs)
        segments = patterns.stack_plan(container, layers, period)
    except ScanError as e:
        surface(e)
    per_layer = _per_layer(layers, broadcast_kwargs, layer_kwargs)
    kinds = patterns.stack_alike(container, layers) if period == "auto" else None
    if kinds is not None:  # one scan choosing each layer's code by kind, where it applies
        out = alike.scan_alike(layers, kinds, hidden, per_layer, remat, _resolve_unroll(unroll))
        if out is not None:
            return out
    for seg in segments:
        hidden = _run_segment(container, layers, seg, hidden, per_layer, remat, unroll)
    return hidden


def _run_segment(container, layers, seg, hidden, per_layer, remat, unroll):
    if seg.period > 1:
        members = blocks.blocks_of(container, layers, seg)
        block_kwargs = [{"block_kwargs": tuple(per_layer[seg.start + b * seg.period + k] for k in range(seg.period))}
                        for b in range(seg.count)]
        return scan_layers(members, hidden, remat=remat, unroll=unroll, layer_kwargs=block_kwargs)
    if seg.count == 1:
        out = layers[seg.start](hidden, **per_layer[seg.start])
        written_rows.settle(per_layer[seg.start])
        return blocks.hidden_of(out, seg.start)
    run = slice(seg.start, seg.start + seg.count)
    out = scan_layers(layers[run], hidden, remat=remat, unroll=unroll, layer_kwargs=per_layer[run])
    return blocks.hidden_of(out, seg.start)
