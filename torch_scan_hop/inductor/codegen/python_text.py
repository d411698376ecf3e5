"""Text passes over inductor's generated Python wrapper for scan's counted loops (run in the
order ``passes.PYTHON_WRAPPER`` declares, once the wrapper's code is generated): the loop
counter's init kernels and per-step calls dropped, small per-step buffers allocated once before
the loop, and buffers the loop's body no longer needs released after it.

Why text: the passes need the generated code as a whole (a buffer's last use, the block a
name is bound in), which only exists once ``PythonWrapperCodegen.generate`` has run; they
match the exact lines torch 2.9 to 2.15 write (``async_compile.cpp_pybinding``,
``empty_strided_cpu``, ``del`` lists) and leave any line they do not recognise as it is
(``passes`` checks first that the lines of those kinds are all recognised).
"""

import re

_ONE_STORE = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\['int64_t\*'\], r?'''$")  # torch 2.15 writes r'''
_CALL_ONE = re.compile(r"^( *)(\w+)\((\w+)\)$")


def drop_counter_inits(code):
    """The generated wrapper ``code`` without the C++ kernels whose only work is to set the
    counter of a loop that runs as ``for <loop>_step in range(n)``.

    That loop reads its index from the Python loop variable, never from the counter
    (``codegen_dynamic_scalar`` above), yet the counter the lowering gave the while_loop
    (``torch.zeros``: inductor's own codegen, kept for dynamic lengths and the C++ wrapper,
    does read it) still got a kernel of its own in a forward graph: one more C++ file to
    build on the first call, one of three for the tanh RNN's forward. A kernel is dropped
    only when its one argument is an ``int64_t*`` (it can write nothing but that buffer)
    and every call of it passes the counter of such a loop; its definition stays as a
    tuple of its signature and source, so nothing is compiled and the line map holds."""
    lines = code.split("\n")
    defs = {m.group(1): i for i, line in enumerate(lines) if (m := _ONE_STORE.match(line))}
    if not defs:
        return code
    counters = set()
    for i, line in enumerate(lines[1:], 1):
        if loop := _FOR.match(line):
            head = re.match(rf"^{loop.group(1)}{loop.group(2)} = \[(\w+)[,\]]", lines[i - 1])
            if head:
                counters.add(head.group(1))
    calls = {}
    for i, line in enumerate(lines):
        if (m := _CALL_ONE.match(line)) and m.group(2) in defs:
            calls.setdefault(m.group(2), []).append((i, m.group(1), m.group(3)))
    for kernel, sites in calls.items():
        mentions = sum(len(re.findall(rf"\b{kernel}\b", line)) for line in lines)
        if mentions != 1 + len(sites) or any(arg not in counters for _, _, arg in sites):
            continue
        for i, indent, arg in sites:
            lines[i] = f"{indent}pass  # {kernel}({arg}): a for loop's counter, never read"
        lines[defs[kernel]] = unbuilt(lines[defs[kernel]])
    return "\n".join(lines)


def unbuilt(definition):
    """A kernel's definition line (``k = async_compile.cpp_pybinding([...], '''``) that builds
    nothing: a tuple of its signature and source, so no C++ is compiled for a kernel no statement
    calls, and the code keeps its lines (the wrapper's line map holds)."""
    return definition.replace("async_compile.cpp_pybinding(", "(", 1)


_COUNT_STEP = re.compile(r"^( *)torch\.ops\.torch_scan_hop\.count_step\.default\((\w+)\)$")


def drop_counter_steps(code):
    """The generated wrapper ``code`` without the ``count_step`` calls (``inductor.counter``)
    of loops that run as ``for <loop>_step in range(n)``: their index is the loop variable,
    and stepping a counter nothing reads costs an operator call (~3 us) per iteration. The
    counter is the body's first input (``<name> = <loop>[0]``)."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        loop = _FOR.match(line)
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        end = _body_end(lines, i, indent)
        first = re.compile(rf"^ *(\w+) = {name}\[0\]$")
        counter = next((m.group(1) for line in lines[i + 1:end] if (m := first.match(line))), None)
        for k in range(i + 1, end):
            if (m := _COUNT_STEP.match(lines[k])) and m.group(2) == counter:
                lines[k] = f"{m.group(1)}pass  # count_step({counter}): a for loop's counter, never read"
    return "\n".join(lines)


_POOL_MAX_BYTES = 1 << 20  # per buffer: above it an allocation costs little next to the kernels that fill it
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
_FOR = re.compile(r"^( *)for (\w+)_step in range\((\w+)\):$")
STEPS_CALL = re.compile(r"^( *)scan_steps_(\w+)\(")  # a counted loop run as one C++ kernel (loop_kernel)
_ALLOC = re.compile(r"^(\w+) = empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)$")


def pool_loop_buffers(code):
    """The generated wrapper ``code`` with the CPU buffers our counted loops allocate every
    iteration taken from two per loop, allocated once, used by turns.

    Measured on the tanh RNN's training step (H=64, B=8): a loop iteration's
    ``empty_strided_cpu`` calls cost 1.5-3 us of the backward step's ~15 us (a fresh
    64x64 weight-gradient buffer per step page-faults). Two buffers per allocation
    line suffice when nothing allocated in iteration i is alive in iteration i+2: the
    body's outputs are the next iteration's carried inputs, and a carried input that
    leaves as an output at another position (``(a, b) -> (b, a + b)``) would keep an
    iteration-i buffer alive longer, so a loop with such an output, or an output
    this cannot trace to an allocation (a view of a carried input, an extern kernel's
    result), is left as it is; a view inductor makes of a fresh buffer in its place (``b2 =
    reinterpret_tensor(b1, ...); del b1  # reuse``: a bias gradient summed as (1, n), handed
    on as (n,)) lives in that buffer's storage, so it is pooled with it. Line numbers do not
    change (the pools are created on the line before the ``for``), so inductor's line map
    stays right."""
    lines = code.split("\n")
    for i in range(len(lines) - 1, 0, -1):
        loop = _FOR.match(lines[i])
        if loop is None:
            continue
        indent, name, n = loop.group(1), loop.group(2), loop.group(3)
        if not lines[i - 1].startswith(f"{indent}{name} = ["):
            continue
        pools = _plan_pools(lines, i, indent + "    ", name)
        if not pools:
            continue
        slots = 1 if n == "1" else 2
        created = []
        for k, (j, var, call) in enumerate(pools):
            pool = f"{name}_pool{k}"
            created.append(f"{pool} = ({', '.join([call] * slots)},)")
            lines[j] = f"{indent}    {var} = {pool}[{name}_step & 1]" if slots == 2 else f"{indent}    {var} = {pool}[0]"
        lines[i - 1] += "; " + "; ".join(created)
    return "\n".join(lines)


def _plan_pools(lines, start, body_indent, name):
    """``[(line index, variable, allocation call)]`` of the loop at ``lines[start]`` whose
    buffers can be pooled, or [] if the loop's outputs do not allow it."""
    carried, fresh, outputs, allocs = {}, set(), [], []
    take = re.compile(rf"^(\w+) = {name}\[(\d+)\]$")
    give = re.compile(rf"^{name}\[(\d+)\] = (\w+)$")
    # inductor hands a buffer on under another name, or as a view of it (a (1, n) sum read as (n,))
    reuse = re.compile(r"^(\w+) = (?:(\w+)|reinterpret_tensor\((\w+), .*\)); del (?:\2|\3)  # reuse$")
    j = start + 1
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith(body_indent)):
        line = lines[j]
        if line.startswith(body_indent) and not line[len(body_indent)].isspace():
            text = line[len(body_indent):]
            if m := take.match(text):
                carried[m.group(1)] = int(m.group(2))
            elif m := give.match(text):
                outputs.append((int(m.group(1)), m.group(2)))
            elif m := _ALLOC.match(text):
                fresh.add(m.group(1))
                if _nbytes(m.group(2), m.group(3)) <= _POOL_MAX_BYTES:
                    allocs.append((j, m.group(1), text[len(m.group(1)) + 3:]))
            elif (m := reuse.match(text)) and (m.group(2) or m.group(3)) in fresh:
                fresh.add(m.group(1))
        j += 1
    for position, var in outputs:
        if carried.get(var) != position and var not in fresh:
            return []
    return allocs


def _nbytes(shape, dtype):
    size = _ITEMSIZE.get(dtype)
    if size is None:
        return _POOL_MAX_BYTES + 1
    for d in shape.replace(" ", "").split(","):
        if d:
            size *= int(d)
    return size


def release_finished_loops(code):
    """The generated wrapper ``code`` with what a finished counted loop still holds deleted:
    the variables its inlined body left bound, and its list of carried values
    (``<loop> = [...]``) after its last use.

    A Python ``for`` leaves its body's variables bound after the loop: a body's inputs
    (``b_arg2_1 = buf5[2]``: a scan's stacked buffers among them) and its last buffers.
    Inductor frees the list when it frees the loop's outputs, but where none is read through
    it (a scan's stacked values, used by the buffers it was handed) never. In a loop nested
    in another loop's body both kept the last iteration's buffers alive into the next one:
    in traced ``remat="sqrt"``'s backward one block's saved activations twice (at T=4096 a
    fifth of the step's peak). Each ``del`` goes in front of a statement at the loop's
    indentation (body variables: the first after the loop; the list: the first after its
    last use). A name read anywhere after the loop, or a list inductor deletes itself, is
    left alone. A loop run as one C++ kernel (``loop_kernel``: its call, then its body as comments)
    binds no body variables; its list is deleted the same way. Line numbers do not change."""
    lines = code.split("\n")
    for i in range(len(lines) - 1, -1, -1):  # inner loops first: their dels are then part of the outer body
        loop = _FOR.match(lines[i]) or STEPS_CALL.match(lines[i])
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        end = _body_end(lines, i, indent)
        later = "\n".join(lines[end:])
        bound = [v for v in _left_bound(lines[i + 1:end], indent + "    ") if not re.search(rf"\b{v}\b", later)]
        dels = {}
        if bound and (at := _next_statement(lines, end, indent)) is not None:
            dels[at] = [f"del {', '.join(bound)}"]
        if (at := _after_last_use(lines, end, indent, name)) is not None:
            dels.setdefault(at, []).append(f"del {name}")
        for at, stmts in dels.items():
            lines[at] = f"{indent}{'; '.join(stmts)}; {lines[at][len(indent):]}"
    return "\n".join(lines)


_ASSIGNED = re.compile(r"^(\w+) = ")
_DELETED = re.compile(r"(?:^|; )del (\w+(?:, \w+)*)")


def _body_end(lines, start, indent):
    j = start + 1
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent + " ")):
        j += 1
    return j


def _left_bound(body, body_indent):
    """Variables the body surely leaves bound: assigned by its own statements or in a
    ``with`` block of them (CUDA kernels run under a device guard), not deleted after.
    A name deleted in any nested block may be unbound at the end: it is left alone."""
    bound, headers = {}, []  # headers: (indent, opens a `with`) of the blocks around a line
    for line in body:
        if not line.strip() or not line.startswith(body_indent):
            continue
        depth = len(line) - len(line.lstrip())
        while headers and headers[-1][0] >= depth:
            headers.pop()
        text = line.strip().split("  #")[0]
        if (m := _ASSIGNED.match(text)) and all(is_with for _, is_with in headers):
            bound[m.group(1)] = None
        for m in _DELETED.finditer(text):
            for v in m.group(1).split(", "):
                bound.pop(v, None)
        if text.endswith(":"):
            headers.append((depth, text.startswith("with ")))
    return list(bound)


def _block(lines, start, indent):
    """Indices from ``start`` to the end of the block at ``indent`` (blank lines included)."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith(indent)
                                and not lines[end][len(indent):len(indent) + 1].isspace()):
        end += 1
    return range(start, end)


def _next_statement(lines, start, indent):
    """The first line in the block from ``start`` a ``del`` can go in front of, or None."""
    for k in _block(lines, start, indent):
        text = lines[k][len(indent):]
        if text.strip() and not text.startswith("#") and not text.rstrip().endswith(":"):
            return k
    return None


def _after_last_use(lines, end, indent, name):
    """Where the list ``name`` of the loop whose body ends at ``end`` can be deleted, or None."""
    used = re.compile(rf"\b{name}\b")
    block = _block(lines, end, indent)
    last = None
    for k in block:
        if used.search(lines[k]):
            if re.search(rf"\bdel {name}\b", lines[k]):
                return None  # inductor deletes it itself
            last = k
    if any(used.search(line) for line in lines[block.stop:]):  # read in a deeper block, or after this one
        return None
    return _next_statement(lines, end if last is None else last + 1, indent)
