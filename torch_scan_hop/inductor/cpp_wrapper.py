"""Inductor's C++ wrapper (``cpp_wrapper=True``, AOTInductor): knowing that a
graph gets one (``cpp_wrapper_active``: code that must not call back into Python, read by
``counter`` and ``buffer_pool``), and two torch 2.9 defects of its while_loop codegen.
Installed by ``lowering``; inductor's classes are ``_compat.inductor``'s adapters.

Checked against torch 2.15's ``torch/_inductor``: ``_InProcessFxCompile.codegen_and_compile``
still takes ``graph_kwargs``; its C++ wrapper pairs mutated while_loop carries itself
(``_get_while_loop_carried_output_names``), so that fix is skipped there.
"""
import functools
import threading

from .. import _compat

_inductor = _compat.inductor

_compiling = threading.local()  # .cpp_wrapper: the graph_kwargs of the compile running on this thread


def track_cpp_wrapper_compiles():
    """Record, for ``cpp_wrapper_active``, whether the graph inductor is compiling
    (post-grad passes included) gets a C++ wrapper. ``config.cpp_wrapper`` does not
    say so: ``compile_fx`` turns it OFF and passes ``cpp_wrapper=True`` on in the
    inner compile's ``graph_kwargs`` instead; only ``options={"cpp_wrapper": True}``
    (and AOTInductor) patch the config back on around the inner compile. With the
    global ``torch._inductor.config.cpp_wrapper = True`` our pass therefore emitted
    the buffer pool's Python operator into a C++ wrapper, whose torch 2.9 codegen
    reads a one-element ``Tensor[]`` result as a single tensor (a NULL handle: the
    process segfaulted). Minimal reproducer of that inductor defect (torch 2.9;
    torch 2.15 prints ``tensor([4., 4., 4.])``)::

        torch._inductor.config.cpp_wrapper = True
        lib = torch.library.Library("demo", "DEF")
        lib.define("one(Tensor x) -> Tensor[]")
        lib.impl("one", lambda x: [x + 1], "CompositeExplicitAutograd")
        torch.library.register_fake("demo::one", lambda x: [torch.empty_like(x)], lib=lib)
        torch.compile(lambda x: torch.ops.demo.one(x)[0] * 2)(torch.ones(3))  # SIGSEGV

    torch 2.9 to 2.15: ``compile_fx._InProcessFxCompile.codegen_and_compile(gm,
    example_inputs, inputs_to_check, graph_kwargs)`` runs the post-grad passes (also
    in a compile subprocess; ``_compat.inductor.fx_compile``). Idempotent."""
    fx_compile = _inductor.fx_compile()
    codegen = fx_compile.codegen_and_compile
    if getattr(codegen, "_scan_tracks_cpp_wrapper", False):
        return

    @functools.wraps(codegen)
    def codegen_and_compile(self, gm, example_inputs, inputs_to_check, graph_kwargs):
        outer = getattr(_compiling, "cpp_wrapper", False)
        _compiling.cpp_wrapper = bool(graph_kwargs.get("cpp_wrapper", False))
        try:
            return codegen(self, gm, example_inputs, inputs_to_check, graph_kwargs)
        finally:
            _compiling.cpp_wrapper = outer

    codegen_and_compile._scan_tracks_cpp_wrapper = True
    fx_compile.codegen_and_compile = codegen_and_compile


def cpp_wrapper_active():
    """Whether the graph being compiled gets a C++ wrapper (``cpp_wrapper=True`` set
    globally or as an option, AOTInductor): code that must not call back into Python.
    torch 2.9 to 2.15: the inner compile's ``graph_kwargs`` (``track_cpp_wrapper_compiles``),
    ``config.cpp_wrapper`` (on inside a compile with the option) and ``V.aot_compilation``."""
    config, V = _inductor.config(), _inductor.virtualized()
    return bool(getattr(_compiling, "cpp_wrapper", False) or config.cpp_wrapper or V.aot_compilation)


def name_mutated_carries_in_cpp_while_loops():
    """torch 2.9's C++ wrapper pairs a while_loop's carried inputs with its
    ``outputs``, which leave out the carries the body mutates in place (a
    scan's ys buffers): the loop's subgraphs got one input too few and codegen
    asserted (``torch.compile(cpp_wrapper=True)``, AOTInductor). Pair them
    with their ``MutationOutput`` instead, as torch 2.14's
    ``CppWrapperCpu._get_while_loop_carried_output_names`` does. A no-op where
    that method exists. Idempotent."""
    CppWrapperCpu = _inductor.cpp_wrapper_codegen()
    codegen = CppWrapperCpu.codegen_while_loop
    if hasattr(CppWrapperCpu, "_get_while_loop_carried_output_names") or getattr(codegen, "_scan_fixed", False):
        return

    def codegen_while_loop(self, while_loop, stack_output=False):
        outputs = while_loop.outputs
        if outputs is None or len(outputs) == len(while_loop.carried_inputs):
            return codegen(self, while_loop, stack_output)
        mutated = {name: m for m in while_loop.mutation_outputs for name in m.get_mutation_names()}
        rest = iter(outputs)
        while_loop.outputs = [mutated[c.get_name()] if c.get_name() in mutated else next(rest)
                              for c in while_loop.carried_inputs]
        try:
            return codegen(self, while_loop, stack_output)
        finally:
            while_loop.outputs = outputs

    codegen_while_loop._scan_fixed = True
    CppWrapperCpu.codegen_while_loop = codegen_while_loop


def plan_cpp_subgraph_reuse_without_peak_estimate():
    """torch 2.9's C++ wrapper inlines a while_loop's subgraphs into the outer
    graph's lines, and its memory planner then looks a subgraph line's
    scheduler-node index up in the OUTER graph's peak-memory tree: out of range
    (``ValueError: Start index 22 out of bounds``) for a scan_layers training
    step. The estimate only decides whether a freed buffer's storage is worth
    reusing; where it cannot be made, do not reuse (costs memory, never
    correctness). torch 2.9 to 2.15: ``codegen.wrapper.AllocateLine.should_reuse_buffer``.
    Idempotent."""
    AllocateLine = _inductor.wrapper_codegen().AllocateLine
    should_reuse = getattr(AllocateLine, "should_reuse_buffer", None)
    if should_reuse is None or getattr(should_reuse, "_scan_fixed", False):
        return

    def should_reuse_buffer(self, free_line, size):
        try:
            return should_reuse(self, free_line, size)
        except ValueError:  # a line of another graph than the estimate's
            return False

    should_reuse_buffer._scan_fixed = True
    AllocateLine.should_reuse_buffer = should_reuse_buffer
