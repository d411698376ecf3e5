"""Patterned stacks: which layers are of one kind, and how a stack splits into scans.

Today's decoders are rarely one layer repeated: Gemma 3 runs five sliding-window layers per
full-attention one, Qwen3-Next three linear-attention layers per full-attention one,
RecurrentGemma two recurrent blocks per attention block, DeepSeek dense layers before MoE
ones. A scan runs ONE body per step, so a stack becomes, in layer order:

- a scan over blocks of ``p`` consecutive layers when the kinds repeat with period ``p``
  (the body runs each of the block's kinds once; maxtext's "repeatable block + remainder");
- a scan over each run of same-kind layers otherwise (dense layers, then MoE layers);
- single layers, called as they are, for what is left over.

A layer's kind is what selects its code: its module types, its parameters' and buffers' names,
shapes and dtypes, and the plain attributes of its module tree (an attention type, a window
size or None, ``is_sliding``). An attribute that is a different number in every layer
(``layer_idx``) is data, not kind: it would split every layer from every other. The scanned
body still reads only layer 0's (the block's first) value of it, so ``layers.view`` compares
what the body reads with every peer and refuses a difference (a ScanError naming it): a wrong
guess here costs a refusal, never a wrong number.

Plain Python over ints and tuples, computed once per stack (``kinds``) outside any tracer
(under Dynamo, by its tracker at trace time: ``trace_time``);
``plan`` is cheap enough to run in traced code. ``stack_plan`` keeps a container's plan on it
(``scan_model`` makes it before any trace); ``layers.blocks`` the blocks a scan over blocks runs.
"""
import collections

import torch

from .. import _compat
from ..core.trees import ScanError
from . import trace_time

_PLAIN = (bool, int, float, str, type(None))
Segment = collections.namedtuple("Segment", "start period count")  # count blocks of period layers from start


def kinds(layers):
    """One small int per layer: equal ints for layers of one kind (see the module docstring)."""
    trees = [tree_signature(layer) for layer in layers]
    data = _per_layer_data(trees)
    ids, out = {}, []
    for tree in trees:
        key = tuple((path, value) for path, value in tree if path not in data)
        out.append(ids.setdefault(key, len(ids)))
    return tuple(out)


def kinds_traced(layers):
    """``kinds`` from what Dynamo can read: module types and parameter and buffer signatures (it
    cannot enumerate a module's plain attributes). Layers told apart only by attributes fall into
    one kind, and the body's check on read refuses the attribute that differs (a ScanError, never
    a wrong number); ``scan_model``, a first eager call or Dynamo's tracker at trace time
    (``trace_time``) read the full kinds."""
    seen, out = [], []
    for layer in layers:
        sig = _weights_signature(layer)
        for i, other in enumerate(seen):
            if other == sig:
                out.append(i)
                break
        else:
            out.append(len(seen))
            seen.append(sig)
    return tuple(out)


def _weights_signature(module):
    sig = [type(module)]
    for name, t in module._parameters.items():
        sig.append((name, None if t is None else (tuple(t.shape), t.dtype)))
    for name, t in module._buffers.items():
        sig.append((name, None if t is None else (tuple(t.shape), t.dtype)))
    for name, child in module._modules.items():
        sig.append((name, None if child is None else tuple(_weights_signature(child))))
    return sig


def tree_signature(module, prefix=""):
    """``[(path, value)]``: every module's type, parameter and buffer signature, and plain attribute."""
    sig = [(prefix + "<type>", f"{type(module).__module__}.{type(module).__qualname__}")]
    for name, t in module._parameters.items():
        sig.append((prefix + name, None if t is None else ("param", tuple(t.shape), t.dtype, t.requires_grad)))
    for name, t in module._buffers.items():
        sig.append((prefix + name, None if t is None else ("buffer", tuple(t.shape), t.dtype)))
    for name, value in vars(module).items():
        if not name.startswith("_") and _is_plain(value):
            sig.append((prefix + name, value))
    for name, child in _compat.nn.child_modules(module).items():
        if child is None:
            sig.append((prefix + name, None))
        else:
            sig.extend(tree_signature(child, prefix + name + "."))
    return sig


def _is_plain(value):
    return type(value) in _PLAIN or type(value) is tuple and all(type(v) in _PLAIN for v in value)


def _per_layer_data(trees):
    """The attribute paths holding a different number in every layer that has them (``layer_idx``;
    an attention's, present in the attention layers only)."""
    if len(trees) < 2:
        return frozenset()
    columns = collections.defaultdict(list)
    for tree in trees:
        for path, value in tree:
            columns[path].append(value)
    return frozenset(
        path for path, values in columns.items()
        if len(values) >= 2 and all(type(v) in (int, float) for v in values)
        and len(set(values)) == len(values))


def period(ks):
    """The smallest ``p`` with ``ks[i] == ks[i % p]`` for every ``i`` (``len(ks)`` when none is smaller)."""
    n = len(ks)
    for p in range(1, n + 1):
        if all(ks[i] == ks[i % p] for i in range(p, n)):
            return p
    return n


def plan(ks, max_period=None):
    """The stack's segments in layer order: ``Segment(start, period, count)``.

    ``period == 1``: a scan over ``count`` layers of one kind (a single layer when count is 1);
    ``period > 1``: a scan over ``count`` blocks of ``period`` layers. The whole stack's period
    is used when it repeats at least twice (and is at most ``max_period``); the layers left over,
    and stacks that do not repeat, are split into runs of one kind."""
    n = len(ks)
    if n == 0:
        return ()
    p = period(ks)
    segments = []
    done = 0
    if p > 1 and n // p >= 2 and (max_period is None or p <= max_period):
        segments.append(Segment(0, p, n // p))
        done = n // p * p
    segments.extend(runs_from(ks, done))
    return tuple(segments)


def runs_from(ks, start):
    """``ks[start:]`` split into runs of one kind, in order: one ``Segment(i, 1, count)`` each."""
    out, i = [], start
    while i < len(ks):
        j = i
        while j + 1 < len(ks) and ks[j + 1] == ks[i]:
            j += 1
        out.append(Segment(i, 1, j - i + 1))
        i = j + 1
    return out


def describe(segments, alike=None):
    """A line per segment, for errors and ``scan_model``'s summary; with ``alike`` (``stack_alike``'s
    kinds) a first line for the one scan over every layer, the segments then being what runs where
    that scan does not apply."""
    lines = []
    if alike is not None:
        lines.append(f"layers 0-{len(alike) - 1}: one scan over {len(alike)} layers of {max(alike) + 1} kinds, each "
                     "step running its layer's kind (traced, no cache or state kept per layer; else:)")
    for s in segments:
        if s.period > 1:
            lines.append(f"layers {s.start}-{s.start + s.period * s.count - 1}: one scan over {s.count} blocks "
                         f"of {s.period} layers")
        elif s.count > 1:
            lines.append(f"layers {s.start}-{s.start + s.count - 1}: one scan over {s.count} layers")
        else:
            lines.append(f"layer {s.start}: called as it is")
    return lines


def stack_plan(container, layers, period):
    """The segments of ``layers`` for ``period`` (an int or "auto"), cached on a module container
    for the layers it holds now (``blocks_of`` caches the blocks alike: made outside a traced call
    when the first call ran, or ``scan_model`` prepared them, outside one)."""
    if period != "auto" and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
        raise ScanError(f"scan_layers: period must be a positive int or 'auto', got {period!r}.")
    cache = container_cache(container, "_scan_layers_plans")
    key = (len(layers), period)
    hit = cache.get(key)
    if hit is not None and same_modules(hit[0], layers):  # a layer replaced since: planned again
        return hit[1]
    if _compat.is_dynamo_compiling():  # not cached: the full kinds read at trace time, else the weights'
        ks = trace_time.ask(kinds, None, list(layers))
        return _segments(kinds_traced(layers) if ks is None else ks, len(layers), period)
    segments = _segments(kinds(layers), len(layers), period)
    cache[key] = (tuple(layers), segments)
    return segments


def stack_alike(container, layers):
    """Per layer its kind numbered 0.. in order of first use when ``layers.alike`` may run the
    stack as one scan choosing each layer's code by kind (every layer has one weight signature,
    and the layers are of several kinds), else None. Read outside Dynamo (the plain attributes)
    and cached on the container as the plan is; under Dynamo with no cached answer, read at trace
    time (``trace_time``), or None."""
    cache = container_cache(container, "_scan_layers_alike")
    hit = cache.get(len(layers))
    if hit is not None and same_modules(hit[0], layers):
        return hit[1]
    if _compat.is_dynamo_compiling():  # not cached: read at trace time (None where it cannot be)
        return trace_time.ask(alike_kinds, None, list(layers))
    value = alike_kinds(layers)
    cache[len(layers)] = (tuple(layers), value)
    return value


def alike_kinds(layers):
    """``stack_alike``'s answer, not cached."""
    ks, weights = kinds(layers), kinds_traced(layers)
    if len(set(weights)) == 1 and len(set(ks)) > 1 and not _grouped_experts(layers[0]):
        order = {}
        return tuple(order.setdefault(k, len(order)) for k in ks)
    return None


def _grouped_experts(layer):
    """A weight of 3 or more dims: an MoE's experts stacked (GPT-OSS). Their routing inside
    ``torch.cond`` fails in Dynamo (torch 2.9 and 2.15: the branch graph gets the cond's first
    operands twice, "duplicate argument 'child'"), so such stacks keep the pattern's plan."""
    return any(p.dim() >= 3 for p in layer.parameters())


def same_modules(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _segments(ks, depth, period):
    if period == "auto":
        return plan(ks)
    count = depth // period if period > 1 else 0
    head = [Segment(0, period, count)] if count >= 1 else []
    rest = plan(ks[count * period:], max_period=1)
    return tuple(head) + tuple(s._replace(start=s.start + count * period) for s in rest)


def container_cache(container, name):
    """A dict kept on a module container (plain attribute reads and writes: Dynamo traces those)."""
    if not isinstance(container, torch.nn.Module):
        return {}
    cache = getattr(container, name, None)
    if cache is None:
        cache = {}
        setattr(container, name, cache)
    return cache
