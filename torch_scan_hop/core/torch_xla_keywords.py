"""torch_xla's own scan keywords (``partition_fn``, ``is_fn_pure``, ``is_layer_pure``) mapped onto ours.

WHY: code written for ``torch_xla.experimental.scan.scan(fn, init, xs, partition_fn=...,
is_fn_pure=...)`` and ``torch_xla.experimental.scan_layers.scan_layers(layers, x, partition_fn=...,
is_layer_pure=...)`` should run unchanged on ours. Without this, ``scan`` refuses them with a bare
TypeError, and ``scan_layers`` (whose other keywords go to every layer) hands them to each layer's
forward: a layer taking ``**kwargs`` (Hugging Face's, torch_xla's own decoder example) drops them, so a
min-cut partitioner the user asked for would silently not run.

- ``partition_fn`` is what ``remat`` already accepts (an AOTAutograd partition function). functorch's
  two stock partitioners map to the policies that name them, so a plain-eager scan stays the loop:
  ``default_partition`` -> ``"save_all"``, ``min_cut_rematerialization_partition`` -> ``"min_cut"``
  (which, traced, IS that partitioner).
- ``is_fn_pure`` / ``is_layer_pure`` let torch_xla reuse a trace keyed on the function object alone.
  Ours reuses a trace only for an identical graph (``trace/cache.py``), which is always safe, so the
  flag changes nothing and is accepted for drop-in use.
"""
from .. import _compat
from .trees import ScanError, shown

_STOCK = ("save_all", "min_cut")


def remat_with_torch_xla_keywords(remat, partition_fn, purity_name, purity, where):
    """``remat`` with torch_xla's ``partition_fn`` folded in, once its purity flag
    (``is_fn_pure`` / ``is_layer_pure``, named ``purity_name``) is checked."""
    check_purity_flag(purity, purity_name, where)
    return remat_from_partition_fn(remat, partition_fn, where)


def remat_from_partition_fn(remat, partition_fn, where):
    """``remat`` with torch_xla's ``partition_fn`` folded in (None: not given)."""
    if partition_fn is None:
        return remat
    if not (isinstance(remat, str) and remat == "save_all"):
        raise ScanError(f"{where}: pass remat= or partition_fn= (torch_xla's name for it), not both; "
                        f"got remat={remat!r} and partition_fn={shown(partition_fn)}.")
    if not callable(partition_fn):
        raise ScanError(f"{where}: partition_fn must be an AOTAutograd partition function "
                        f"(torch_xla's keyword, our remat=), got {shown(partition_fn)}.")
    for name in _STOCK:
        if partition_fn is _compat.partitioner(name):
            return name
    return partition_fn


def check_purity_flag(value, name, where):
    """torch_xla's trace-cache flag: a bool or None, accepted and otherwise ignored."""
    if value is not None and not isinstance(value, bool):
        raise ScanError(f"{where}: {name} must be a bool (torch_xla's trace-cache flag; ours caches only "
                        f"identical graphs, so it changes nothing), got {shown(value)}.")
