"""Remat policies: what each scan step keeps for its backward, as plain objects.

A policy is a ``RematPolicy``: a function ``save(op, name) -> bool`` of the op
that computed a value (an ``aten`` OpOverload) and the name ``checkpoint_name``
gave it (None otherwise), as JAX's ``jax.checkpoint_policies`` are functions of
the primitive and its params. Values it saves are kept; everything else the
backward needs is recomputed from the step's carry and x. The same object
drives every path: the eager loop replays a step with the saved values
(``remat/replay.py``), the traced paths partition the step's joint graph
with it (``trace/partition.py``), so eager, make_fx, torch.compile, export and
XLA keep the same values.

``offload`` is a field, not another API: a device ("cpu") that saved values
live on between the forward and the backward (host memory for a CUDA scan).

The strings stay: "save_all", "recompute_all", "min_cut" (traced: functorch's
min-cut partitioner; eager: keep at most half of save_all's bytes per step,
for the least recompute, ``remat/keep.py``), "sqrt" (eager: only every k-th carry, k ~ sqrt(T), each
block recomputed once in the backward) and ``("binomial", k)`` (eager: at most
k carries, placed as revolve places them; stands in graphs as "binomial:k").
Traced, "sqrt" of a static length is two scans (``api._sqrt_scan``: an outer scan
over blocks saving one carry per block, an inner one over a block's steps);
binomial, and "sqrt" of a symbolic length, are "recompute_all".
"""
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..core import route, trace_lock
from ..core.trees import ScanError

STRINGS = ("save_all", "min_cut", "recompute_all", "sqrt")
# What ``remat=`` takes: a name, ("binomial", k), a RematPolicy or an AOTAutograd partition function.
Remat = Union[str, tuple[str, int], "RematPolicy", Callable[..., Any]]


# ``checkpoint_name`` is the identity in eager; traced it is this op so that the
# name reaches the joint graph the partitioner reads (the op is dropped from the
# partitioned graphs and from body graphs: it never costs a copy there).
@torch.library.custom_op("torch_scan_hop::named_value", mutates_args=())
def _named_value(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


@_named_value.register_fake
def _(x, name):
    return torch.empty_like(x)


_named_value.register_autograd(lambda ctx, grad: (grad, None))
NAMED_VALUE = torch.ops.torch_scan_hop.named_value.default

_local = threading.local()  # the eager replay engines whose steps run now on this thread


def namers():
    """This thread's stack of engines that ``checkpoint_name`` calls go to (the last one)."""
    stack = getattr(_local, "namers", None)
    if stack is None:
        stack = _local.namers = []
    return stack


@contextlib.contextmanager
def naming(engine):
    """``checkpoint_name`` calls inside this block go to ``engine.named`` (remat/replay.py)."""
    stack = namers()
    stack.append(engine)
    try:
        yield
    finally:
        stack.pop()


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``x`` inside a scan body as ``name``, for a policy that saves by name.

    As JAX's ``checkpoint_name``: the mark is how ``save_only_these_names`` (and any
    ``RematPolicy`` reading ``name``) picks what a step keeps for its backward, since a value
    has no other stable name across eager and traced runs.

    Args:
        x: a tensor computed in the body.
        name: the name a policy sees.

    Returns:
        ``x`` itself outside a scan with such a policy (the identity); in an eager scan's
        replay the value the engine keeps or recomputes; traced, ``x`` through an identity op
        that carries the name into the step's graph (dropped from the partitioned graphs).

    Raises:
        ScanError: ``name`` is not a str or ``x`` not a tensor.

    Example:
        >>> import torch
        >>> from torch_scan_hop import checkpoint_name, save_only_these_names, scan
        >>> W = torch.randn(4, 4, requires_grad=True)
        >>> def cell(h, x):
        ...     pre = checkpoint_name(h @ W + x, "pre")  # kept; tanh recomputed from it
        ...     return torch.tanh(pre), None
        >>> h, _ = scan(cell, torch.zeros(4), torch.randn(8, 4), remat=save_only_these_names("pre"))
    """
    if not isinstance(name, str):
        raise ScanError(f"checkpoint_name: name must be a str, got {type(name).__name__}.")
    if not isinstance(x, torch.Tensor):
        raise ScanError(f"checkpoint_name: expects a tensor, got {type(x).__name__}.")
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace the thread-local's creation
        return NAMED_VALUE(x, name)
    stack = namers()
    if stack:
        return stack[-1].named(x, name)
    if not route.runs_the_loop([x]) or trace_lock.under_make_fx():
        return NAMED_VALUE(x, name)
    return x


@dataclass(frozen=True)
class RematPolicy:
    """What each scan step keeps for its backward: ``save(op, name) -> bool`` per value.

    As ``jax.checkpoint_policies``, a policy is a plain function of the op that computed a value
    (an ``aten`` OpOverload) and its ``checkpoint_name`` (None if unnamed; a named value has
    ``op`` = the naming op itself), so one object drives eager (the replay engine) and every
    traced path (the partitioner) alike. Values it does not keep are recomputed in the
    backward from the step's carry and x.

    Args:
        save: ``save(op, name) -> bool``, True to keep the value.
        offload: the device kept values wait on between forward and backward ("cpu": a CUDA
            scan's saved values in host memory; eager scans only), None to keep them in place.
        label: how the policy is shown in errors and graph tokens.

    Raises:
        ScanError: ``save`` is not callable or ``offload`` not a device.

    Example:
        >>> import torch
        >>> from torch_scan_hop import RematPolicy, scan
        >>> keep_matmuls = RematPolicy(lambda op, name: op is torch.ops.aten.mm.default)
        >>> W = torch.randn(4, 4, requires_grad=True)
        >>> h, _ = scan(lambda h, x: (torch.tanh(h @ W + x), None), torch.zeros(1, 4),
        ...             torch.randn(8, 1, 4), remat=keep_matmuls)
    """

    save: Callable[[Any, str | None], bool]
    offload: str | None = None
    label: str = "custom"

    def __post_init__(self):
        if not callable(self.save):
            raise ScanError(f"RematPolicy: save must be a function (op, name) -> bool, got {self.save!r}.")
        if self.offload is not None and not isinstance(self.offload, (str, torch.device)):
            raise ScanError(f"RematPolicy: offload must be a device such as 'cpu' or None, got {self.offload!r}.")

    def with_offload(self, device="cpu"):
        """The same policy, saved values kept on ``device`` (host memory by default)."""
        return RematPolicy(self.save, device, self.label)

    def saves(self, op, name=None):
        return bool(self.save(op, name))

    @property
    def reads_ops(self):
        """False for a policy that only looks at names: eager then needs no dispatch mode."""
        return not isinstance(self.save, _Names)


@functools.lru_cache(maxsize=None)
def dot_ops():
    """Matmuls, convolutions and attention: the ops worth saving rather than recomputing."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _save_dots(op, name):
    return op in dot_ops()


def _save_nothing(op, name):
    return False


def _save_everything(op, name):
    return True


dots_saveable = RematPolicy(_save_dots, label="dots_saveable")
nothing_saveable = RematPolicy(_save_nothing, label="nothing_saveable")
everything_saveable = RematPolicy(_save_everything, label="everything_saveable")


class _Names:
    """``save`` of ``save_only_these_names``: a named value whose name is listed."""

    def __init__(self, names):
        self.names = frozenset(names)

    def __call__(self, op, name):
        return name is not None and name in self.names

    def __repr__(self):
        return f"save_only_these_names{tuple(sorted(self.names))}"

    def __eq__(self, other):
        return isinstance(other, _Names) and other.names == self.names

    def __hash__(self):
        return hash(self.names)


@torch.compiler.assume_constant_result  # built in a compiled function: Dynamo calls it and keeps the object
def save_only_these_names(*names, offload=None):
    """Save only the values marked ``checkpoint_name(x, n)`` with ``n`` in ``names``;
    recompute everything else (JAX's ``save_only_these_names``)."""
    if not names or not all(isinstance(n, str) for n in names):
        raise ScanError(f"save_only_these_names: expects one or more str names, got {names!r}.")
    return RematPolicy(_Names(names), offload, label=f"save_only_these_names{names!r}")


_TOKENS, _POLICIES = {}, {}


def as_token(remat):
    """A policy object as the string that stands for it in graphs and cache keys
    (an FX node cannot hold a function); strings and partition functions as they are."""
    if not isinstance(remat, RematPolicy):
        return remat
    token = _TOKENS.get(remat)
    if token is None:
        token = f"policy:{len(_POLICIES)}:{remat.label}"
        _TOKENS[remat], _POLICIES[token] = token, remat
    return token


def resolve(remat):
    """A token back to its policy object; anything else as it is."""
    if isinstance(remat, str) and remat.startswith("policy:"):
        return _POLICIES[remat]
    return remat


def as_policy(remat):
    """The policy object a string stands for in eager ("save_all" -> None: the plain tape; "min_cut"
    -> dots_saveable where a per-call checkpoint serves it, scan_layers' layers: a scan's own engine
    runs min_cut by recipes, remat/recipes.py)."""
    remat = resolve(remat)
    if isinstance(remat, RematPolicy) or remat is None:
        return remat
    check_remat(remat)
    if binomial_slots(remat) is not None:
        return nothing_saveable
    return {"save_all": None, "recompute_all": nothing_saveable, "min_cut": dots_saveable,
            "sqrt": nothing_saveable}[remat]


def normalize(remat):
    """``("binomial", k)`` as the string ``"binomial:k"`` (a constant graphs and Dynamo can hold)."""
    if isinstance(remat, tuple) and len(remat) == 2 and remat[0] == "binomial":
        k = remat[1]
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ScanError(f"scan: remat=('binomial', k) keeps k carries, k an int >= 1; got k={k!r}.")
        return f"binomial:{k}"
    return remat


def binomial_slots(remat):
    """k of "binomial:k", else None."""
    if isinstance(remat, str) and remat.startswith("binomial:"):
        return int(remat.split(":", 1)[1])
    return None


def is_policy(remat):
    return isinstance(remat, RematPolicy) or (isinstance(remat, str) and (
        remat in STRINGS or remat in _POLICIES or binomial_slots(remat) is not None))


def validated(remat, where="scan"):
    """THE remat validator: ``remat`` as the op, the engines and graphs take it (``("binomial", k)``
    as ``"binomial:k"``), or a ScanError naming what is accepted. Every entry that takes a
    ``remat`` (``scan``, ``fwd_bwd``; ``scan_layers`` through ``scan``) asks here once, so the rules
    and partitioners below meet valid values only."""
    remat = normalize(remat)
    check_remat(remat, where)
    return remat


def check_remat(remat, where="scan"):
    """Bad ``remat`` values are a ScanError naming what is accepted (the one "not a policy" message)."""
    if not (callable(remat) or is_policy(remat)):
        raise ScanError(f"{where}: remat={remat!r} is not a policy; use one of {STRINGS}, ('binomial', k), a RematPolicy "
                        "(dots_saveable, save_only_these_names(...)) or an AOTAutograd partition function.")
