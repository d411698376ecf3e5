"""Running an ordered list of passes over a generated wrapper's text, and saying what each did.

Why a pipeline: a pass recognises lines inductor writes (``empty_strided_cpu(...)``,
``async_compile.cpp_pybinding(...)``, ``aoti_torch_empty_strided(...)``). When a new torch writes
them differently the pass no longer matches; before, the text then went through unchanged and the
compiled scan got slower with nothing said. Here every pass is declared once, in order
(``passes``), with two checks besides its rewrite:

- ``wants(code)``: whether the text holds what the pass works on (our counted loops, which we
  write ourselves). No: the pass is skipped, quietly (most graphs hold no scan).
- ``broken(code)``: a reason when the text holds inductor lines of the kind the pass rewrites that
  it cannot read (the sign of a torch that writes them another way), else None.

A pass whose precondition fails, or that raises, stops the pipeline: the wrapper is used as
inductor generated it (the for loops our codegen wrote are right without any text pass; only the
speed-ups are lost), with ONE ``WrapperPassWarning`` naming the pass and the reason. Each graph's
outcome is logged at debug level on ``torch_scan_hop.inductor.codegen`` and counted per pass
(``pass_counts``): applied (the text changed), skipped (not wanted, or nothing to change), failed.
"""
import collections
import contextlib
import dataclasses
import logging
import threading
import warnings
from typing import Callable, Optional

log = logging.getLogger("torch_scan_hop.inductor.codegen")


class WrapperPassWarning(RuntimeWarning):
    """A wrapper pass could not read inductor's generated code: the compiled scan runs the
    wrapper as generated (right, maybe slower)."""


@dataclasses.dataclass(frozen=True)
class Pass:
    """One named rewrite of a wrapper's text. ``rewrite(code, context)`` returns the whole new
    text (or ``code`` itself); ``wants``/``broken`` are described in the module docstring."""

    name: str
    rewrite: Callable[[str, dict], str]
    wants: Callable[[str, dict], bool]
    broken: Callable[[str, dict], Optional[str]] = lambda code, context: None


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The passes of one wrapper kind (``"python"``, ``"cpp"``), in the order they run."""

    kind: str
    passes: tuple


class PreconditionFailed(Exception):
    """Raised inside ``run`` for a pass whose ``broken`` gave a reason."""


_lock = threading.Lock()
_counts = collections.defaultdict(collections.Counter)  # pass name -> Counter(applied=, skipped=, failed=)
_off = set()  # names of passes turned off by ``passes_off`` (tests, bisecting a slowdown)


def run(pipeline, code, context=None):
    """``code`` after every pass of ``pipeline``, or ``code`` itself when a pass fails. A pass may
    append ``(name, outcome)`` pairs to ``context["decisions"]`` (what it chose per call, such as
    ``small_gemm``'s per matmul): counted like ``record``'s, only when its text is the one used."""
    context = dict(context or {}, decisions=[])
    original, outcomes = code, {}
    for p in pipeline.passes:
        try:
            code, outcomes[p.name] = _run_one(p, code, context)
        except Exception as error:  # noqa: BLE001 - any failure of a pass means: use inductor's text
            _record({p.name: "failed"})  # the passes before it fired on a text now dropped: not counted
            _warn(pipeline, p, error)
            return original
    _record(outcomes)
    for name, how in context["decisions"]:
        _record({name: how})
    log.debug("%s wrapper: %s", pipeline.kind, ", ".join(f"{name} {how}" for name, how in outcomes.items()))
    return code


def _run_one(p, code, context):
    """``(new code, outcome)`` of one pass; raises when it cannot read ``code``."""
    if p.name in _off or not p.wants(code, context):
        return code, "skipped"
    reason = p.broken(code, context)
    if reason is not None:
        raise PreconditionFailed(reason)
    new = p.rewrite(code, context)
    if not isinstance(new, str):
        raise TypeError(f"the pass returned {type(new).__name__}, not the code")
    return new, "applied" if new != code else "skipped"


def _warn(pipeline, p, error):
    what = str(error) if isinstance(error, PreconditionFailed) else f"{type(error).__name__}: {error}"
    message = (f"torch_scan_hop: the {pipeline.kind} wrapper pass {p.name!r} could not read inductor's "
               f"generated code ({what}); the compiled scan runs the code as inductor generated it "
               "(right, but without the loop's speed-ups). Please report it with your torch version.")
    log.debug(message, exc_info=not isinstance(error, PreconditionFailed))
    warnings.warn(message, WrapperPassWarning, stacklevel=2)


def is_off(name):
    """Whether ``passes_off`` turned ``name`` off (also for decisions that are not text passes)."""
    return name in _off


def record(name, outcome):
    """Count one outcome (``"applied"``, ``"skipped"``, ``"failed"``) of a codegen decision that
    is not a text pass (a counted loop written as a ``for``, a matmul as a BLAS call)."""
    _record({name: outcome})


def _record(outcomes):
    with _lock:
        for name, how in outcomes.items():
            _counts[name][how] += 1


def pass_counts():
    """``{pass name: {"applied": n, "skipped": n, "failed": n}}`` since the last
    ``reset_pass_counts`` (every graph compiled in this process, both wrapper kinds)."""
    with _lock:
        return {name: {how: c[how] for how in ("applied", "skipped", "failed")} for name, c in _counts.items()}


def reset_pass_counts():
    with _lock:
        _counts.clear()


@contextlib.contextmanager
def passes_off(*names):
    """Within this block the named passes are skipped (as if they never matched): to compare a
    pass's output with the code without it, or to find which pass a wrong result comes from."""
    added = set(names) - _off
    _off.update(added)
    try:
        yield
    finally:
        _off.difference_update(added)
