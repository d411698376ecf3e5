"""Symbolic sizes computed again from traced values: ``KnownSizes``.

Why: a size a trace needs (a preallocated ys buffer's shape, the backward step's symbolic sizes)
may come out of a graph run on stand-ins, outside the trace. Put in the traced graph as it is, it
is not a value the trace made; computed again in Python from SymInts the trace holds (an input's
sizes and strides) it is, as upstream's scan decomposition preallocates its ys
(``post_grad.resolve_shape_to_proxy``). Inductor's lowering and the autograd rule both do this.
"""
import sympy
import torch

from .. import _compat


class KnownSizes:
    """SymInts as values computed from ``known`` ({sympy expression: SymInt}).

    A key may be a compound expression whose symbols no input carries (xs made by
    ``cat([a, a])``: length ``2*s``): it stands for itself, substituted as a whole first."""

    def __init__(self, known):
        self._compound = {e: sympy.Dummy() for e in known if not e.is_symbol}
        self._env = {self._compound.get(e, e): v for e, v in known.items()}

    def _expr(self, value):
        expr = value.node.expr
        if expr in self._compound:
            return self._compound[expr]
        if expr in self._env:  # a known symbol is itself: substituted, ``s`` with ``s**2`` known became sqrt
            return expr
        return expr.subs(self._compound) if self._compound else expr

    def computable(self, value):
        """Does every symbol of the SymInt ``value`` come from a known one?"""
        return self._expr(value).free_symbols <= self._env.keys()

    def value_of(self, value):
        """``value`` (a SymInt) computed in Python from the known SymInts; an int as it is."""
        if not isinstance(value, torch.SymInt):
            return value
        return _compat.inductor.python_value_of(self._expr(value), self._env)
