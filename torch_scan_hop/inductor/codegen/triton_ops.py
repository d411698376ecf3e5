"""The pointwise aten/prims ops a scan body may hold to run as ONE Triton kernel, each as Triton text.

Why a table of its own: ``triton_scan`` walks a body graph and asks, per node, "what Triton
expression computes this, one element of the carry per lane?". Only ops whose value at an element
depends on the operands at that same element qualify (no matmul, no reduction, no indexing); a
view qualifies when it only inserts, removes or expands size-1 dims, since then every value of the
body is still a function of one element of the carry's shape (``triton_scan`` checks the dims).
An op missing here makes the whole scan keep inductor's loop: never a half-translated body.

Every value lives in a register in its *compute* dtype: float32 for float16/bfloat16 (as
inductor computes them), else its own; a cast to a narrower float rounds through that dtype.
"""
import math
from typing import Callable, Optional

import torch

aten = torch.ops.aten
prims = torch.ops.prims

FLOATS = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
          torch.float64: "tl.float64"}
NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"  # torch.maximum/clamp propagate NaN; tl's default does not


# The math functions with no ``tl`` builtin, called in kernels as ``_<name>(x)``: libdevice's on a GPU;
# under Triton's interpreter (tests on the CPU, no libdevice) these ``tl`` expressions of ``x``
# (``triton_scan`` writes both definitions into each kernel module).
HELPERS = {"tanh": "2.0 * tl.sigmoid(2.0 * x) - 1.0", "log1p": "tl.log(1.0 + x)", "expm1": "tl.exp(x) - 1.0",
           "sqrt": "tl.sqrt(x)", "rsqrt": "1.0 / tl.sqrt(x)"}


def _helper(name):
    assert name in HELPERS, name
    return lambda x: f"_{name}({x})"


def round_to(dtype: torch.dtype) -> str:
    """The text that rounds a value through a narrow float ``dtype`` (float16/bfloat16; else none),
    as storing it in that dtype does."""
    return f".to({FLOATS[dtype]})" if dtype in (torch.float16, torch.bfloat16) else ""


class Refused(Exception):
    """The body holds something one pointwise kernel cannot compute (the reason says what)."""


def compute_type(dtype: torch.dtype) -> str:
    """The Triton type a value of ``dtype`` is computed in; refuses dtypes other than float and bool."""
    if dtype == torch.bool:
        return "tl.int1"
    if dtype in (torch.float16, torch.bfloat16):
        return "tl.float32"
    if dtype in FLOATS:
        return FLOATS[dtype]
    raise Refused(f"a value of dtype {dtype}")


def literal(value) -> str:
    """A Python scalar operand as Triton source (finite numbers and bools only)."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    raise Refused(f"a scalar operand {value!r}")


def _bin(fmt):
    return lambda a, b: fmt.format(a=a, b=b)


def _arith(a, b, alpha, op):
    b = b if alpha == "1" else f"({alpha} * {b})"
    return f"({a} {op} {b})"


def _pow(x, e):
    if e == 0.5:
        return _helper("sqrt")(x)
    if e == -0.5:
        return _helper("rsqrt")(x)
    if float(e) == int(e) and -4 <= int(e) <= 4 and int(e) != 0:
        n = int(e)
        prod = " * ".join([f"({x})"] * abs(n))
        return f"({prod})" if n > 0 else f"(1.0 / ({prod}))"
    raise Refused(f"pow with exponent {e!r}")


# op -> (kind, emit). kind: "arith" (operands cast to the result's compute type), "compare"
# (operands cast to their common type), "logic" (bool operands), "keep" (the value unchanged).
_UNARY = {
    aten.neg.default: lambda x: f"(-{x})",
    aten.exp.default: lambda x: f"tl.exp({x})",
    aten.log.default: lambda x: f"tl.log({x})",
    aten.log1p.default: _helper("log1p"),
    aten.expm1.default: _helper("expm1"),
    aten.sqrt.default: _helper("sqrt"),
    aten.rsqrt.default: _helper("rsqrt"),
    aten.tanh.default: _helper("tanh"),
    aten.sigmoid.default: lambda x: f"tl.sigmoid({x})",
    aten.relu.default: lambda x: f"tl.maximum({x}, 0.0, {NAN_ALL})",
    aten.abs.default: lambda x: f"tl.abs({x})",
    aten.reciprocal.default: lambda x: f"(1.0 / {x})",
    aten.sign.default: lambda x: f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, {x} * 0.0))",  # NaN stays NaN
}
_BINARY = {
    aten.mul.Tensor: _bin("({a} * {b})"), aten.mul.Scalar: _bin("({a} * {b})"),
    aten.div.Tensor: _bin("({a} / {b})"), aten.div.Scalar: _bin("({a} / {b})"),
    aten.maximum.default: _bin("tl.maximum({a}, {b}, " + NAN_ALL + ")"),
    aten.minimum.default: _bin("tl.minimum({a}, {b}, " + NAN_ALL + ")"),
}
_COMPARE = {
    aten.eq.Tensor: "==", aten.eq.Scalar: "==", aten.ne.Tensor: "!=", aten.ne.Scalar: "!=",
    aten.lt.Tensor: "<", aten.lt.Scalar: "<", aten.le.Tensor: "<=", aten.le.Scalar: "<=",
    aten.gt.Tensor: ">", aten.gt.Scalar: ">", aten.ge.Tensor: ">=", aten.ge.Scalar: ">=",
}
_LOGIC = {aten.logical_and.default: "&", aten.logical_or.default: "|", aten.logical_xor.default: "^",
          aten.bitwise_and.Tensor: "&", aten.bitwise_or.Tensor: "|", aten.bitwise_xor.Tensor: "^"}
_ARITH_ALPHA = {aten.add.Tensor: "+", aten.add.Scalar: "+", aten.sub.Tensor: "-", aten.sub.Scalar: "-"}
SIZE_ONE_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                  aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
                  prims.squeeze.default}
EXPANDS = {aten.expand.default, aten.expand_copy.default}
COPIES = {aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default}
CASTS = {prims.convert_element_type.default, aten._to_copy.default}
CONSTANTS = {aten.full.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
             aten.scalar_tensor.default}


def constant_value(node) -> float:
    """The fill value of a ``full``/``*_like``/``scalar_tensor`` node."""
    target = node.target
    if target is aten.zeros_like.default:
        return 0
    if target is aten.ones_like.default:
        return 1
    return node.args[1] if target in (aten.full.default, aten.full_like.default) else node.args[0]


def cast_target(node) -> torch.dtype:
    """The dtype of a cast node, refusing a ``_to_copy`` that also changes device or layout."""
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    extra = set(node.kwargs) - {"dtype", "layout", "device", "pin_memory", "memory_format"}
    if extra or len(node.args) != 1 or node.kwargs.get("dtype") is None:
        raise Refused(f"a _to_copy with {sorted(node.kwargs)}")
    return node.kwargs["dtype"]


def expression(node, operand: Callable[[object, Optional[str]], str], out_type: str) -> str:
    """The Triton expression of the pointwise ``node`` (its result's compute type ``out_type``).
    ``operand(arg, as_type)``: an argument (a node or a scalar) as text, cast to ``as_type``
    (None: as it is)."""
    target, args = node.target, node.args
    if target in _UNARY:
        _only(node, 1)
        return _UNARY[target](operand(args[0], out_type))
    if target in _BINARY:
        _only(node, 2)
        return _BINARY[target](operand(args[0], out_type), operand(args[1], out_type))
    if target in _ARITH_ALPHA:
        if set(node.kwargs) - {"alpha"}:
            raise Refused(f"{target} with {sorted(node.kwargs)}")
        alpha = literal(node.kwargs.get("alpha", args[2] if len(args) > 2 else 1))
        return _arith(operand(args[0], out_type), operand(args[1], out_type), alpha, _ARITH_ALPHA[target])
    if target is aten.rsub.Scalar:
        _only(node, 2)
        return f"({operand(args[1], out_type)} - {operand(args[0], out_type)})"
    if target in _COMPARE:
        _only(node, 2)
        common = _common_type(args)
        return f"({operand(args[0], common)} {_COMPARE[target]} {operand(args[1], common)})"
    if target in _LOGIC:
        _only(node, 2)
        return f"(({operand(args[0], 'tl.int1')}) {_LOGIC[target]} ({operand(args[1], 'tl.int1')}))"
    if target is aten.logical_not.default:
        return f"({operand(args[0], None)} == 0)"
    if target is aten.where.self:
        _only(node, 3)
        return f"tl.where({operand(args[0], 'tl.int1')}, {operand(args[1], out_type)}, {operand(args[2], out_type)})"
    if target in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
        return _clamp(node, operand(args[0], out_type))
    if target in (aten.pow.Tensor_Scalar,):
        _only(node, 2)
        return _pow(operand(args[0], out_type), args[1])
    raise Refused(f"the op {target}")


def _only(node, n):
    if node.kwargs or len(node.args) != n:
        raise Refused(f"{node.target} with {len(node.args)} args and {sorted(node.kwargs)}")


def _common_type(args):
    dtypes = [a.meta["val"].dtype for a in args if hasattr(a, "meta")]
    common = dtypes[0] if dtypes else torch.float32
    for d in dtypes[1:]:
        common = torch.promote_types(common, d)
    return None if len(set(dtypes)) <= 1 else compute_type(common)


def _clamp(node, x):
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if node.target is aten.clamp_max.default:
        low, high = None, node.args[1]
    for bound in (low, high):
        if bound is not None and not isinstance(bound, (int, float)):
            raise Refused("a clamp with tensor bounds")
    if low is not None:
        x = f"tl.maximum({x}, {literal(low)}, {NAN_ALL})"
    if high is not None:
        x = f"tl.minimum({x}, {literal(high)}, {NAN_ALL})"
    return x
