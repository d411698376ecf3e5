"""A counted loop of the Python wrapper whose body only calls C++ kernels, run as ONE C++ kernel:
the body's kernels as functions of one source and a ``for (step ...)`` loop calling them.

Why: with the body's lines inlined in ``for <loop>_step in range(n)`` (``python_loop``),
a step of the tanh RNN (H=64, B=8, one thread) still ran ~15 Python statements around its two kernel
calls (the carried list, a pooled buffer, a ``reinterpret_tensor`` for the y's row, the kernels'
argument parsing): ~1 us of a ~2.7 us step, the gap between the Python wrapper's loop and the C++
wrapper's (issue 40 item 2). Those statements only choose pointers, which the C++ loop computes
as the Python one did: a carried value is the previous step's output, a pooled buffer is slot
``step & 1`` of its pool, a view is its base's data pointer plus its offset in elements.

When: a loop of the generated wrapper text (after ``python_text``'s passes) of at least
``_MIN_STEPS`` steps, or of a dynamic length, whose body's statements are all recognised:
reads of the carried list, aliases of outer tensors and of the loop variable, pooled buffers,
``reinterpret_tensor`` views (an element offset: the view keeps its base's dtype), ``del``,
calls of ``async_compile.cpp_pybinding`` kernels (inductor's CPU kernels, ``blas``'s
sgemm) with tensors and integer expressions, and writes of the carried list with a carried
value at its own position, a pooled buffer or an outer tensor. Anything else (an ATen call, an
allocation, a nested loop, a GPU kernel, a statement of another shape) keeps the Python loop.

Numbers: the same kernel sources, called with the same pointers in the same order; each is a
function the compiler may not inline, clone or look into (``noipa``), so its code is what its
own build made of it (same compile flags: ``kernel_build`` builds the loop's kernel as
``cpp_pybinding`` builds the others, linked and loaded differently). Line count: unchanged (the
call and the carried list's last values on the ``for`` line, the body's lines kept as comments,
the kernel's definition, ``kernel_build.deferred_kernel``, on the line of ``async_compile.wait``);
kernels left with no caller are not built (their definitions become tuples), so a cold cache
builds one C++ file instead of the body's kernels. torch 2.9 to 2.15: ``cpp_pybinding(argtypes,
source)`` with ``extern "C" void kernel(...)``, pointer arguments as tensors (their data pointer),
``int64_t`` as Python ints; ``_reinterpret_tensor(base, size, stride, offset)`` adds ``offset`` to
base's storage offset.
"""
import ast
import re

from . import kernel_build
from .accumulate import accumulate_in_place
from .python_text import _FOR, STEPS_CALL, _body_end, unbuilt

_MIN_STEPS = 64  # as blas: below it one more C++ build on a cold cache does not pay back
_DEF = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\((\[[^\]]*\]), r?'''$")
_WAIT = "async_compile.wait(globals())"
_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(')
_INT_EXPR = re.compile(r"^[\w\s+\-*()]+$")
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


def run_loops_as_one_kernel(code):
    """The Python wrapper ``code`` with each counted loop that ``_plan`` accepts replaced by a
    call of one C++ kernel running all its steps (module docstring)."""
    lines = code.split("\n")
    kernels = _cpp_kernels(lines)
    wait = next((i for i, line in enumerate(lines) if line == _WAIT), None)
    if not kernels or wait is None:
        return code
    defined = []
    for i in range(len(lines) - 1, wait, -1):
        loop = _FOR.match(lines[i])
        if loop is None or not _long_enough(loop.group(3)):
            continue
        plan = _plan(lines, i, loop.group(1), loop.group(2), loop.group(3), kernels)
        if plan is not None:
            defined.append(_write(lines, i, plan, kernels))
    if not defined:
        return code
    lines[wait] = "; ".join(defined + [lines[wait]])
    _skip_unused_builds(lines, kernels)
    return "\n".join(lines)


def _long_enough(n):
    return not n.isdigit() or int(n) >= _MIN_STEPS


def _cpp_kernels(lines):
    """``{name: (argtypes, source, definition line)}`` of the ``cpp_pybinding`` kernels."""
    kernels = {}
    for i, line in enumerate(lines):
        m = _DEF.match(line)
        if m is None:
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "''')"), None)
        if end is not None:
            kernels[m.group(1)] = (ast.literal_eval(m.group(2)), "\n".join(lines[i + 1:end]), i)
    return kernels


class _Plan:
    """What the C++ loop needs: its parameters (carried values, pool slots, outer tensors and
    ints) and its statements, from the Python loop's body."""

    def __init__(self, loop, n):
        self.loop, self.n = loop, n
        self.carried, self.pools, self.outer, self.ints = set(), {}, {}, {}
        self.calls, self.writes, self.fixups, self.kernels = [], [], [], []
        self.call_args = []  # per call: (kernel, its arguments as the env's values or ("int", C++))
        self.written = {}  # carried position: the env's value written back to it

    def outer_tensor(self, name):
        return self.outer.setdefault(name, f"o{len(self.outer)}")

    def outer_int(self, name):
        return self.ints.setdefault(name, f"i{len(self.ints)}")


def _plan(lines, start, indent, loop, n, kernels):
    """A ``_Plan`` of the loop at ``lines[start]``, or None where any statement is not one we
    can run in C++ (or a name its body binds is read after it)."""
    end = _body_end(lines, start, indent)
    body_indent = indent + "    "
    plan, env = _Plan(loop, n), {}
    for line in lines[start + 1:end]:
        if not line.strip():
            continue
        if not line.startswith(body_indent) or line[len(body_indent)].isspace():
            return None  # a nested block
        if not _statement(line[len(body_indent):], plan, env, kernels):
            return None
    later = "\n".join(lines[end:])
    if any(re.search(rf"\b{name}\b", later) for name in [*env, f"{loop}_step"]):
        return None
    accumulate_in_place(plan)
    return plan


def _statement(text, plan, env, kernels):
    """Record ``text`` (one statement of the body) in ``plan``/``env``; False if not ours."""
    loop = plan.loop
    if text.startswith(("#", "pass  # ")) or re.fullmatch(r"del \w+(, \w+)*(; del \w+(, \w+)*)*", text):
        return True
    if m := re.fullmatch(rf"(\w+) = {loop}\[(\d+)\]", text):
        plan.carried.add(int(m.group(2)))
        env[m.group(1)] = ("tensor", f"c{m.group(2)}", None, ("carry", int(m.group(2))))
        return True
    if m := re.fullmatch(rf"(\w+) = ({loop}_pool\d+)\[(?:{loop}_step & 1|0)\]", text):
        slot = "step & 1" if text.endswith("& 1]") else "0"
        pool = plan.pools.setdefault(m.group(2), f"pool{len(plan.pools)}")
        env[m.group(1)] = ("tensor", f"{pool}[{slot}]", None, ("pool", m.group(2)))
        return True
    if m := re.fullmatch(rf"(\w+) = {loop}_step", text):
        env[m.group(1)] = ("int", "step")
        return True
    if m := re.fullmatch(r"(\w+) = None", text):
        env[m.group(1)] = ("none",)
        return True
    if (m := re.fullmatch(r"(\w+) = (\w+)(?:; del \2  # reuse)?", text)) and not m.group(2).isdigit():
        env[m.group(1)] = env.get(m.group(2), ("outer", m.group(2)))  # an outer tensor or int: known at its use
        return True
    if m := re.fullmatch(r"(\w+) = (reinterpret_tensor\(.*\))  # alias", text):
        env[m.group(1)] = _tensor(m.group(2), plan, env)
        return env[m.group(1)] is not None
    if m := re.fullmatch(r"(\w+) = (reinterpret_tensor\((\w+), (.*)\)); del \3  # reuse", text):
        env[m.group(1)] = _pooled_view(m.group(2), env.get(m.group(3)), m.group(4), plan, env)
        return env[m.group(1)] is not None
    if m := re.fullmatch(rf"{loop}\[(\d+)\] = (\w+)", text):
        return _write_back(int(m.group(1)), _as_tensor(env.get(m.group(2), ("outer", m.group(2))), plan), plan)
    if (m := re.fullmatch(r"(\w+)\((.*)\)", text)) and m.group(1) in kernels:
        return _call(m.group(1), m.group(2), plan, env, kernels)
    return False


def _as_tensor(value, plan):
    """``value`` of the env as a tensor (an outer name becomes a tensor parameter), or None."""
    if value[0] == "outer":
        return ("tensor", plan.outer_tensor(value[1]), None, value)
    return value if value[0] == "tensor" else None


def _tensor(arg, plan, env):
    """``("tensor", base, element offset or None, origin)`` of a kernel's tensor argument."""
    arg = arg.strip()
    if m := re.fullmatch(r"reinterpret_tensor\((.*)\)", arg):
        parts = _split(m.group(1))
        if len(parts) != 4:
            return None
        base, offset = _tensor(parts[0], plan, env), _int(parts[3], plan, env)
        if base is None or offset is None:
            return None
        total = offset if base[2] is None else f"{base[2]} + {offset}"
        return ("tensor", base[1], total, ("view",))
    if not re.fullmatch(r"\w+", arg) or arg.isdigit():
        return None
    return _as_tensor(env.get(arg, ("outer", arg)), plan)


def _pooled_view(view, base, view_args, plan, env):
    """A view inductor makes of a buffer in its place (``b2 = reinterpret_tensor(b1, size,
    stride, offset); del b1  # reuse``): the view's tensor value. Of a pooled buffer at offset 0
    it keeps the pool as its origin (its data pointer is the slot's), with the view's arguments:
    written back, the loop's last value is that view of the pool's last slot (``_write_back``)."""
    value = _tensor(view, plan, env)
    if value is None or base is None or base[0] != "tensor" or base[3][0] != "pool" \
            or _split(view_args)[-1] != "0":
        return value
    return (*value[:3], ("pool", base[3][1], view_args))


def _int(expr, plan, env):
    """``expr`` (an integer expression of the wrapper: literals, the loop variable, size
    symbols) as C++, or None. No ``//`` or ``%``: Python's and C++'s differ on negatives."""
    expr = expr.strip()
    if not _INT_EXPR.match(expr):
        return None
    names = set(_NAME.findall(expr))
    values = {name: env.get(name, ("outer", name)) for name in names}
    if any(value[0] not in ("int", "outer") for value in values.values()):
        return None

    def cpp(m):
        kind, value = values[m.group(0)]
        return value if kind == "int" else plan.outer_int(value)
    out = re.sub(r"\b\d+\b", lambda m: f"{m.group(0)}LL", expr)
    return "(" + _NAME.sub(cpp, out) + ")"


def _call(kernel, args, plan, env, kernels):
    """A call of a ``cpp_pybinding`` kernel as a C++ call: a pointer argument gets its tensor's
    data pointer (cast to the kernel's type), an ``int64_t`` its expression; any other argument
    type (a float, a tensor list) keeps the Python loop."""
    argtypes = kernels[kernel][0]
    parts = _split(args)
    if len(parts) != len(argtypes) or any("=" in p for p in parts) or not _composable(kernels[kernel][1]):
        return False
    cpp, values = [], []
    for arg, argtype in zip(parts, argtypes):
        if argtype.endswith("*"):
            value = _tensor(arg, plan, env)
            if value is None:
                return False
            _, base, offset, _ = value
            cpp.append(f"({argtype})({base})" if offset is None else f"(({argtype})({base}) + {offset})")
        elif argtype.replace("const ", "").strip() == "int64_t":
            value = _int(arg, plan, env)
            if value is None:
                return False
            cpp.append(value)
            value = ("int", value)
        else:
            return False
        values.append(value)
    if kernel not in plan.kernels:
        plan.kernels.append(kernel)
    plan.calls.append(f"scan_steps_k{plan.kernels.index(kernel)}::kernel({', '.join(cpp)});")
    plan.call_args.append((kernel, values))
    return True


def _composable(source):
    """Whether a kernel's source can go in a namespace of the loop's source: one entry point,
    and no preprocessor lines but ``#include`` (moved to the top) and ``#pragma``."""
    directives = [line.lstrip() for line in source.split("\n") if line.lstrip().startswith("#")]
    return len(_ENTRY.findall(source)) == 1 and all(d.startswith(("#include", "#pragma")) for d in directives)


def _write_back(position, value, plan):
    """``<loop>[position] = value`` at the end of a step: C++ keeps the pointer, Python gets the
    tensor after the loop (``fixups``). A value the Python loop could hand on in other ways
    (a view, another position's carried value) keeps the Python loop."""
    if value is None:
        return False
    origin = value[3]
    if origin == ("carry", position):
        return True
    loop, n = plan.loop, plan.n
    if origin[0] == "pool":
        last = f"{origin[1]}[({n} - 1) & 1]" if value[1].endswith("[step & 1]") else f"{origin[1]}[0]"
        if len(origin) == 3:  # a view of the pooled buffer (``_pooled_view``)
            last = f"reinterpret_tensor({last}, {origin[2]})"
    elif origin[0] == "outer":
        last = origin[1]
    else:
        return False
    plan.carried.add(position)
    plan.written[position] = value
    plan.writes.append(f"c{position} = {value[1]};")
    plan.fixups.append(f"{loop}[{position}] = {last} if {n} > 0 else {loop}[{position}]")
    return True


def _split(args):
    """Top-level comma-separated parts of ``args``."""
    parts, depth, current = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += (ch in "([") - (ch in ")]")
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _write(lines, start, plan, kernels):
    """Replace the loop at ``lines[start]`` by the call (its body's lines kept as comments) and
    return the kernel's definition."""
    indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
    end = _body_end(lines, start, indent)
    carried = sorted(plan.carried)
    params = [f"void* c{k}" for k in carried]
    args = [f"{plan.loop}[{k}]" for k in carried]
    for pool, cpp in plan.pools.items():
        params += [f"void* {cpp}_0", f"void* {cpp}_1"]
        args += [f"{pool}[0]", f"{pool}[-1]"]
    params += [f"void* {cpp}" for cpp in plan.outer.values()]
    args += list(plan.outer)
    params += [f"const int64_t {cpp}" for cpp in plan.ints.values()] + ["const int64_t n"]
    args += list(plan.ints) + [plan.n]
    name = f"scan_steps_{plan.loop}"
    assert STEPS_CALL.match(f"{indent}{name}(")
    source = _source(plan, kernels, params)
    argtypes = [p.rsplit(" ", 1)[0] for p in params]
    lines[start] = (f"{indent}{name}({', '.join(args)}){''.join('; ' + f for f in plan.fixups)}"
                    f"  # for {plan.loop}_step in range({plan.n}): the body below, in C++")
    for j in range(start + 1, end):
        if lines[j].strip():
            lines[j] = f"{indent}# (in {name}) {lines[j][len(indent):]}"
    return (f"from {kernel_build.__name__} import deferred_kernel as scan_deferred_kernel; "
            f"{name} = scan_deferred_kernel(globals(), {name!r}, {argtypes!r}, {source!r})")


def _source(plan, kernels, params):
    includes, namespaces = [], []
    for k, kernel in enumerate(plan.kernels):
        body = []
        for line in kernels[kernel][1].split("\n"):
            if line.lstrip().startswith("#include"):
                if line.strip() not in includes:
                    includes.append(line.strip())
            else:
                body.append(line)
        text = _ENTRY.sub("SCAN_STEPS_KERNEL void kernel(", "\n".join(body), count=1)
        namespaces.append(f"namespace scan_steps_k{k} {{\n{text}\n}}  // namespace scan_steps_k{k}")
    pools = [f"    void* const {cpp}[2] = {{{cpp}_0, {cpp}_1}};" for cpp in plan.pools.values()]
    step = "\n".join(f"        {s}" for s in plan.calls + plan.writes)
    return "\n".join([
        *includes,
        "#if defined(__clang__)",
        "#define SCAN_STEPS_KERNEL __attribute__((noinline))",
        "#else",
        "#define SCAN_STEPS_KERNEL __attribute__((noipa))",
        "#endif",
        *namespaces,
        f'extern "C" void kernel({", ".join(params)})',
        "{",
        *pools,
        "    for (int64_t step = 0; step < n; ++step) {",
        step,
        "    }",
        "}",
        "",
    ])


def _skip_unused_builds(lines, kernels):
    """Kernels no statement calls any more (only in comments now) are not built: their
    definition builds nothing (``python_text.unbuilt``)."""
    for name, (_, _, at) in kernels.items():
        used = re.compile(rf"\b{name}\b")
        if any(used.search(line) for j, line in enumerate(lines) if j != at and not line.lstrip().startswith("#")):
            continue
        lines[at] = unbuilt(lines[at])
