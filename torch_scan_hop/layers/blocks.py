"""A block of a patterned stack as one module, and its runs of one kind as nested scans.

A scan over blocks (``layers.patterns``: Gemma 3's 5 sliding + 1 full attention layers) runs
one ``LayerBlock`` per step. Flat, the block's body traces every one of its layers: six
decoder layers for Gemma 3, so the trace, the joint graph and XLA's compile of the body cost
six layers' worth, and more than that in the number of ops XLA optimizes at once. Runs of
one kind inside the block (Gemma 3's five sliding layers, Qwen3-Next's three linear-attention
ones, RecurrentGemma's two recurrent blocks) are the same code on different weights: a scan of
their own, nested in the block's step (maxtext's and JAX's nested scan over a repeated block).
The block's body then traces each kind once, whatever the run lengths: Gemma 3 at 16 layers
(two blocks and four sliding layers left over), its first training step under torch.compile,
2026-11-29, 2 cores: aot_eager 79 s flat, 54 s nested; inductor 186 s flat, 132 s nested.

Not on XLA: there the outer body's several traces each trace the nested scan again (no plan is
cached under a tracer), and XLA's CPU compiler took longer over a While nested in a While than
over the flat body (Gemma 3, 16 layers, first step: trace 25 s flat / 24 s nested, XLA compile
18.6 s flat / 24.6 s nested).

Nested only in a traced scan, and only where nothing is handed out of a layer but its hidden
state (``nested_runs``): per-layer state written by the layers (a KV cache's rows, state kept
on the modules, transformers' capture hooks) keeps the flat block, whose bookkeeping is per
position. The run's weights are stacked ``(blocks, run length, ...)`` once per call
(``stack_nested``), so a block's step slices its runs' stacks with no copy per step.
"""
import torch

from .. import _compat
from ..api import scan
from ..core import dtensors as dt
from ..core.trees import ScanError
from . import module_state, patterns
from .layer_kwargs import split as split_kwargs
from .stack_weights import stack_state
from .view import LABELS, view_of, view_parts


class LayerBlock(torch.nn.Module):
    """``period`` consecutive layers as one module: the body of a scan over blocks.

    Built once per block by ``scan_layers`` / ``scan_model`` and kept OUTSIDE the model's
    module tree (the layers stay where they are: ``state_dict`` keys, ``parameters()`` and
    optimizers are unchanged). Its forward runs its layers in order, each with its own
    keyword inputs (``block_kwargs[k]`` for its k-th layer: masks and positions by kind);
    given ``runs`` (a traced scan's choice, ``nested_runs``), each run of one kind longer than
    one layer as a nested scan over the run's stacked weights.

    ``scan_runs``: ``((start, length), ...)``, the block's runs of one kind (``()`` when the
    kinds were not known: made under Dynamo, which cannot read the layers' attributes).
    """

    def __init__(self, layers, runs=()):
        super().__init__()
        for k, layer in enumerate(layers):
            self.add_module(str(k), layer)
        self.scan_runs = tuple(runs)

    def forward(self, hidden_states, block_kwargs, runs=None):
        for start, length in runs or [(k, 1) for k in range(len(block_kwargs))]:  # flat: runs of one
            if length == 1:
                hidden_states = hidden_of(getattr(self, str(start))(hidden_states, **block_kwargs[start]), start)
            else:
                hidden_states = _scan_run(self, start, length, hidden_states, block_kwargs[start:start + length])
        return hidden_states


def hidden_of(out, k):
    """A block's layer returns its hidden state (transformers 5) or ``(hidden,)`` / ``(hidden, None, ...)``."""
    if isinstance(out, tuple):
        if len(out) >= 1 and all(o is None for o in out[1:]):
            return out[0]
        raise ScanError(f"scan_layers: layer {k} of a block returns a tuple with extras {tuple(type(o).__name__ for o in out)}; "
                        "a scan over blocks of different layers carries the hidden state alone. Call the model "
                        "without outputs that layers return (attentions, router logits), or scan without a period.")
    return out


def runs_of(block_kinds):
    """``((start, length), ...)``: the block's positions grouped into runs of one kind."""
    return tuple((seg.start, seg.count) for seg in patterns.runs_from(block_kinds, 0))


def blocks_of(container, layers, seg):
    """The ``LayerBlock`` modules of a segment over blocks, made once per container and made
    again when a layer was replaced since (a block holds its layers: a stale one would run the
    old layer). Each knows its runs of one kind and, for the nested scan's checks on read, every
    layer of each run's kind in the segment (``_run_peers``)."""
    cache = patterns.container_cache(container, "_scan_layers_blocks")
    key = (seg.start, seg.period, seg.count)
    members = [layers[seg.start + b * seg.period: seg.start + (b + 1) * seg.period] for b in range(seg.count)]
    hit = cache.get(key)
    if hit is None or not all(patterns.same_modules(list(block._modules.values()), m) for block, m in zip(hit, members)):
        # under Dynamo only the weights' kinds are known: layers told apart by attributes would
        # share a run and be refused on read; the flat block reads each position's own
        dynamo = _compat.is_dynamo_compiling()
        runs = () if dynamo else runs_of(patterns.kinds(layers)[seg.start:seg.start + seg.period])
        blocks = [LayerBlock(m, runs) for m in members]
        peers = {start: [(f"layer {seg.start + b * seg.period + start + j}", m[start + j])
                         for b, m in enumerate(members) for j in range(length)]
                 for start, length in runs if length > 1}  # the template (block 0's) first
        blocks[0].__dict__["_run_peers"] = peers  # a plain dict: not registered as submodules
        if runs or not dynamo:  # a later call outside Dynamo finds the runs
            cache[key] = blocks
        return blocks
    return hit


def nested_runs(blocks, states, slots, attrs, plan, fsdp_meshes, straight):
    """The runs a traced scan over ``blocks`` nests (None: the flat block). Flat where per-layer
    bookkeeping needs each position in the block's own step: written rows (``slots``, a cache),
    state on the modules (``attrs``), capture hooks (``plan``), FSDP2 or DTensor weights, weights
    on XLA (measured slower: module docstring), or a straight-line scan (``unroll`` over every
    block: nothing to nest)."""
    if not blocks or not isinstance(blocks[0], LayerBlock) or straight:
        return None
    runs = blocks[0].scan_runs
    if not any(length > 1 for _, length in runs) or any(blk.scan_runs != runs for blk in blocks):
        return None
    if any(slots) or attrs or plan is not None or fsdp_meshes is not None:
        return None
    weights = list(states[0].values())
    if any(dt.is_dtensor(t) for t in weights):
        return None
    if _compat.on_xla(weights):  # measured slower there (module docstring)
        return None
    return runs


def stack_nested(states, runs):
    """The scan's xs for nested runs: a name of a position outside every run stacked over the
    blocks ``(blocks, ...)``, as flat; a run's weights under its first position's names, stacked
    ``(blocks, length, ...)`` (one stack of every block's run layers, its gradient reaching each)."""
    count = len(states)
    in_run = {str(start + j) for start, length in runs if length > 1 for j in range(length)}
    outside = [n for n in states[0] if n.split(".", 1)[0] not in in_run]
    out = stack_state([{n: s[n] for n in outside} for s in states]) if outside else {}
    for start, length in runs:
        if length == 1:
            continue
        prefix = f"{start}."
        names = [n[len(prefix):] for n in states[0] if n.startswith(prefix)]
        rows = [{n: s[f"{start + j}.{n}"] for n in names} for s in states for j in range(length)]
        out.update({prefix + n: t.unflatten(0, (count, length)) for n, t in stack_state(rows).items()})
    return out


def _scan_run(block, start, length, hidden, run_kwargs):
    """A run of ``length`` layers of one kind from position ``start`` of ``block`` (the outer
    step's view), as a scan over the run's rows of the block's stacks: the run's first layer's
    code on each row, through a view checked on read against every layer of the run's kind."""
    module, state, prefix = view_parts(block)
    template = module._modules[str(start)]
    first = f"{prefix}{start}."
    rows = {n[len(first):]: t for n, t in state.items() if n.startswith(first)}
    labels, members = zip(*module.__dict__["_run_peers"][start])
    peers = members[1:]  # members[0] is template
    shared, varying = split_kwargs(list(run_kwargs), lambda j: f"layer {start + j} of the block")

    def step(h, xs):
        params, kw_rows = xs
        kwargs = shared if varying is None else varying.rebuild(kw_rows)
        checked = {LABELS: labels}  # its peers named by their place in the stack
        out = view_of(template, params, peers=peers, checked=checked)(h, **kwargs)
        return hidden_of(out, start), module_state.written(checked)

    kw_stacks = [] if varying is None else varying.stacks()
    hidden, written = scan(step, hidden, (rows, kw_stacks))
    _hand_written_to_block(block, start, length, written)
    return hidden


def _hand_written_to_block(block, start, length, written):
    """What a run's layers assigned (RecurrentGemma's ``recurrent_states = None`` without a
    cache) recorded on the block's view per position, as the flat block's body records it:
    None for each, or each layer's row of the run's ys."""
    for path, value in written.items():
        for j in range(length):
            _setattr_path(block, f"{start + j}.{path}", None if value is None else value[j])


def _setattr_path(view, path, value):
    """``view.a.b.name = value`` on the view: kept in the step, never on the module."""
    *parents, name = path.split(".")
    for part in parents:
        view = getattr(view, part)
    setattr(view, name, value)
