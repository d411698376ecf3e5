"""In a counted loop of the Python wrapper (``python_loop``), a carried sum that ``extern_kernels.addmm``
or ``blas``'s ``scan_blas_addmm`` accumulates (a training backward's weight gradient, ``g = addmm(g,
a, b)`` every step) is written into the carry's own buffer: one buffer for the whole loop instead of
three. (A loop run as one C++ kernel does the same in ``accumulate``.)

Why: inductor's ``while_loop`` binds each step's new carry to a new buffer (``N =
empty_strided_*(...)``, or a pooled one): while a step runs the old sum and the new one are both
alive, and the loop's initial value (a zeros buffer the wrapper still names) a third time. For a
4-layer MLP of width 1024 that is 2 x 16 MiB over eager's peak (issue 64 item 5), on the CPU and on
CUDA alike. ``addmm(g, a, b, out=g)`` is ATen's in-place accumulation (``addmm_impl_cpu_`` and the
CUDA one skip the copy of ``self`` when it is the output; ``sgemm`` gets beta 1 on the same operands;
``scan_blas_addmm`` skips it too, taken only where ``self``'s strides are the output's): the same
numbers.

When, for carry ``k`` of loop ``L`` whose body binds ``A = L[k]`` and hands on ``L[k] = N``:

- the body's only blocks are ``with`` blocks and nested loops (no ``if``: every line runs every step),
  and the ``addmm`` is not in a nested loop (it would add once a step of that loop);
- ``A`` is read only as the ``addmm``'s ``self`` (besides its binding and ``del A``): nothing reads
  the old sum after it is overwritten, it is handed on nowhere else, no view of it exists;
- ``N`` is bound once (a fresh ``empty_strided_*`` or a pool slot the body uses nowhere else), not
  mentioned between its binding and the ``addmm`` whose ``out`` it is, at the same indentation, and
  handed on at position ``k`` only.

Then ``N``'s binding becomes ``N = A``: every step writes the sum it reads. The loop must own the
buffer it starts with: the initial value is taken as it is when it is a fresh buffer of the same
layout (``empty_strided_*`` at the list's indentation, before it only written by call statements,
after it named nowhere but in ``del``, in the list once); otherwise the list's line copies it once
into a buffer of ``N``'s layout (``L[k] = empty_strided_*(...).copy_(L[k])``). Anything else is left
as generated. Line numbers do not change (inductor's line map stays right).
"""
import re

from .blas import _ADDMM as _BLAS_ADDMM
from .loop_kernel import _split
from .python_text import _FOR, _body_end

_EMPTY = r"empty_strided_\w+\(\([^()]*\), \([^()]*\), torch\.\w+\)"
_STATIC_EMPTY = re.compile(r"^empty_strided_\w+\(\([\d, ]*\), \([\d, ]*\), torch\.\w+\)$")
_DEL = re.compile(r"^del \w+(, \w+)*$")
_CALL = re.compile(r"^[\w.]+\(.*\)$")


def accumulate_carries_in_place(code):
    """The Python wrapper ``code`` with each accumulation the module docstring describes written into
    its carry's own buffer (inner loops first)."""
    lines = code.split("\n")
    for i in range(len(lines) - 1, 0, -1):
        loop = _FOR.match(lines[i])
        if loop is None:
            continue
        indent, name = loop.group(1), loop.group(2)
        head = _head(lines[i - 1], indent, name)
        if head is None:
            continue
        end = _body_end(lines, i, indent)
        items, pools = head
        for position, binding, fresh, (allocation, pool) in _accumulations(lines, i, end, indent, name, head):
            owned = _owned(lines, i - 1, indent, items, position, allocation)
            if not owned and not _STATIC_EMPTY.match(allocation):
                continue  # a copy's sizes would name symbols bound elsewhere
            lines[binding] = f"{fresh[0]}{fresh[1]} = {fresh[2]}  # accumulated in place"
            pools.pop(pool, None)  # a pool no line takes from any more
            if not owned:
                pools[f"copy{position}"] = f"{name}[{position}] = {allocation}.copy_({name}[{position}])"
            lines[i - 1] = f"{indent}{name} = [{', '.join(items)}]" + "".join(f"; {p}" for p in pools.values())
    return "\n".join(lines)


def _head(line, indent, name):
    """``(items, {pool name: its statement})`` of a loop's list line, or None."""
    if not line.startswith(f"{indent}{name} = ["):
        return None
    parts = line[len(indent):].split("; ")
    if not parts[0].endswith("]"):
        return None
    pools = {}
    for part in parts[1:]:
        m = re.match(rf"^({name}_pool\d+) = \(.*\)$", part)
        if m is None:
            return None
        pools[m.group(1)] = part
    return _split(parts[0][len(name) + 4:-1]), pools


def _accumulations(lines, start, end, indent, name, head):
    """``(position, line of N's binding, (indentation, N, A), (N's allocation, pool or None))`` of
    each accumulation of the loop at ``lines[start]`` that may be written in place."""
    body = lines[start + 1:end]
    if any(_opens_other_block(line) for line in body):
        return []
    text = [line.strip() for line in body]
    bindings = {int(m.group(2)): (k, m.group(1)) for k, t in enumerate(text)
                if (m := re.match(rf"^(\w+) = {name}\[(\d+)\]$", t))}
    handed = {}
    for t in text:
        if m := re.match(rf"^{name}\[(\d+)\] = (\w+)$", t):
            handed.setdefault(m.group(2), []).append(int(m.group(1)))
    found = []
    for position, (at, carry) in bindings.items():
        if sum(t.count(f"{name}[{position}]") for t in text) != 2:
            continue  # the slot read (or written) once more: another name for the old sum
        done = _accumulation(body, text, at, carry, position, handed, name, head[1])
        if done is not None:
            found.append((position, start + 1 + done[0], (done[1], done[2], carry), done[3]))
    return found


def _opens_other_block(line):
    t = line.strip()
    return t.endswith(":") and not t.startswith("#") and not t.startswith("with ") and not _FOR.match(line)


def _accumulation(body, text, at, carry, position, handed, name, pools):
    """``(index of N's binding in body, its indentation, N, (allocation, pool))`` or None."""
    word = re.compile(rf"\b{carry}\b")
    uses = [k for k, t in enumerate(text) if word.search(t) and k != at]
    calls = [k for k in uses if _output_of(text[k], carry) is not None]
    if len(calls) != 1 or any(k != calls[0] and not _is_del_of(text[k], carry) for k in uses):
        return None
    call = calls[0]
    if len(word.findall(text[call])) != 1 or any(k < call for k in uses if k != call) or at > call:
        return None
    out = _output_of(text[call], carry)
    if handed.get(out) != [position] or len(re.findall(rf"\b{out}\b", text[call])) != 1:
        return None
    out_word = re.compile(rf"\b{out}\b")
    binds = [k for k, t in enumerate(text) if re.match(rf"^{out} = ", t)]
    if len(binds) != 1 or not at < binds[0] < call or any(out_word.search(t) for t in text[binds[0] + 1:call]):
        return None
    bound = binds[0]
    if any(_FOR.match(line) for line in body[at:call]):
        return None  # the sum written in a nested loop: once a step of that loop, not of this one
    depth = _depth(body[bound])
    if _depth(body[call]) != depth or any(t and _depth(body[k]) < depth for k, t in
                                          enumerate(text[bound:call], bound)):
        return None
    allocation = _allocation(text[bound], out, name, pools, text)
    if allocation is None:
        return None
    return bound, body[bound][:depth], out, allocation


def _output_of(t, carry):
    """The output of ``t`` when it is an ``addmm`` adding to ``carry`` (ATen's, or ``blas``'s kernel
    with the output's strides those of ``carry``: it skips the copy when the two are one buffer)."""
    if t.startswith(f"extern_kernels.addmm({carry}, ") and (m := re.search(r", out=(\w+)\)$", t)):
        return m.group(1)
    if m := re.match(rf"^{_BLAS_ADDMM}\((\w+), {carry}, (.*)\)$", t):
        strides = _split(m.group(2))[-4:]
        return m.group(1) if len(strides) == 4 and strides[:2] == strides[2:] else None
    return None


def _is_del_of(t, carry):
    statements = [s.strip() for s in t.split("  #")[0].split(";")]
    return any(_DEL.match(s) and carry in s[4:].split(", ") for s in statements) and \
        all(_DEL.match(s) or not re.search(rf"\b{carry}\b", s) for s in statements)


def _depth(line):
    return len(line) - len(line.lstrip())


def _allocation(t, out, name, pools, text):
    """``(allocation call, pool name or None)`` of ``out``'s binding ``t``, or None."""
    if m := re.match(rf"^{out} = ({_EMPTY})$", t):
        return m.group(1), None
    m = re.match(rf"^{out} = ({name}_pool\d+)\[(?:{name}_step & 1|0)\]$", t)
    if m is None or m.group(1) not in pools:
        return None
    pool = m.group(1)
    if sum(len(re.findall(rf"\b{pool}\b", s)) for s in text) != 1:
        return None  # another line takes from the pool too
    made = re.match(rf"^{pool} = \(({_EMPTY}), ", pools[pool])
    return (made.group(1), pool) if made else None


def _owned(lines, head, indent, items, position, allocation):
    """Whether the list's initial value at ``position`` may be written by the loop: a fresh buffer
    of ``allocation``'s layout that nothing else reads or names once the loop starts."""
    item = items[position]
    if not re.fullmatch(r"\w+", item) or sum(len(re.findall(rf"\b{item}\b", x)) for x in items) != 1:
        return False
    if any(_named_besides_del(line, item) for line in lines[head + 1:]):
        return False
    for k in range(head - 1, -1, -1):
        line = lines[k]
        if line.strip() and _depth(line) < len(indent):
            return False
        if not re.search(rf"\b{item}\b", line):
            continue
        if line == f"{indent}{item} = {allocation}":
            return True
        if _depth(line) != len(indent) or not _CALL.match(line.strip()) or re.match(r"^\w+ = ", line.strip()):
            return False
    return False


def _named_besides_del(line, item):
    word = re.compile(rf"\b{item}\b")
    return any(word.search(s) and not _DEL.match(s.strip()) for s in line.split("  #")[0].split(";"))


_ADDMM = re.compile(r"^extern_kernels\.addmm\(.*, out=\w+\)$")


def unreadable_addmm(code):
    """A reason when a counted loop's body calls ``extern_kernels.addmm`` in a form this pass does
    not read (not one statement ending ``out=<name>)``), else None."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        if loop := _FOR.match(line):
            for body_line in lines[i + 1:_body_end(lines, i, loop.group(1))]:
                t = body_line.strip()
                if t.startswith("extern_kernels.addmm(") and not _ADDMM.match(t):
                    return f"an addmm of another form: {t[:120]!r}"
    return None
