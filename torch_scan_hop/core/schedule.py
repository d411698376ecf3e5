"""The loop schedule: which step runs when. Every execution path reads it here.

A scan of ``length`` steps runs the indices ``0..length-1`` (or
``length-1..0`` when ``reverse``). ``unroll=k`` groups them into loop
iterations of k body calls; what does not fill a block (``length % k`` steps)
is a remainder run one step per iteration. The blocked part always runs first
and the remainder last, in execution order; for ``reverse`` the picture is
mirrored (blocks cover the high indices, the remainder the low ones), so the
sequence of steps is exactly the Python loop's either way.
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Input indices ``[start, stop)`` run as ``(stop - start) // unroll`` loop
    iterations of ``unroll`` body calls each, in the scan's direction."""

    start: int
    stop: int
    unroll: int

    @property
    def steps(self):
        return self.stop - self.start

    @property
    def iterations(self):
        return self.steps // self.unroll


def step_index(step, length, reverse=False):
    """The input index that the ``step``-th step to run reads and writes.

    Plain arithmetic, so it also works on a loop counter that is a SymInt or a
    tensor, and on a symbolic ``length`` (a compiled loop's index).
    """
    return length - 1 - step if reverse else step


def one_iteration(length, unroll):
    """Does ``unroll`` run every step in one loop iteration (``segments`` is a single
    block of ``length`` steps)? On XLA such a scan is straight-line code, no While
    (csrc/hlo_straight.h reads the same segments); ``scan_layers`` asks it to pick
    the gradient rows that suit straight-line code."""
    if not isinstance(length, int) or isinstance(unroll, bool) or not isinstance(unroll, int):
        return False  # a symbolic length has one segment of single steps; a bad unroll is scan's error
    blocks = segments(length, unroll)
    return len(blocks) == 1 and blocks[0].unroll == length


def step_order(length, reverse=False):
    """The indices in the order the steps run (the Python loop's order)."""
    return range(length - 1, -1, -1) if reverse else range(length)


def segments(length, unroll=1, reverse=False):
    """The loop as segments in execution order.

    A symbolic (non-int) length gives one segment of single steps: blocks need
    the length to be known. A zero length gives no segment.
    """
    if not isinstance(length, int):
        return (Segment(0, length, 1),)
    if length == 0:
        return ()
    k = max(1, min(int(unroll), length))
    blocked = (length // k) * k
    rest = length - blocked
    if k == 1 or rest == 0:
        return (Segment(0, length, k),)
    if reverse:
        return Segment(rest, length, k), Segment(0, rest, 1)
    return Segment(0, blocked, k), Segment(blocked, length, 1)


def block_order(unroll, reverse=False):
    """Positions within one block, in the order its body calls run."""
    return step_order(unroll, reverse)


def sqrt_block(length):
    """``remat="sqrt"``'s block: k = ceil(sqrt(T)) steps, so that T/k kept carries and
    one block's activations are both ~sqrt(T). The eager engine (``remat/replay.py``)
    and the traced two-level scan (``api._sqrt_scan``) read it here so they block alike."""
    return max(1, math.ceil(math.sqrt(length)))


def sqrt_split(length, reverse=False):
    """The traced ``"sqrt"`` schedule: ``(k, (start, stop))`` with ``[start, stop)`` the
    input indices run as whole blocks of k steps (an outer scan over blocks); the other
    ``length % k`` indices are a tail. As ``segments``, the blocked part runs first in
    execution order: it covers the low indices, or the high ones when ``reverse``."""
    k = sqrt_block(length)
    blocked = (length // k) * k
    return k, ((length - blocked, length) if reverse else (0, blocked))
