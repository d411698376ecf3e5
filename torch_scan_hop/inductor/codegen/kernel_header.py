"""The loop kernel's precompiled header: inductor's own (``cpp_prefix.h``, GCC), made once more with
the template instantiations it leaves pending already done, so that the kernel's build does not do
them (issue 62: the first call of a compiled scan waits for this one build).

Why: when GCC writes a precompiled header it stops before the end of the translation unit, where it
instantiates the function templates that the header's inline functions use (``vec512_int.h``'s
``shift_512_8``, the complex ``blend``s, ``<cmath>``'s special functions, ...: ~1700 functions).
Every file that includes the header then does them at its end: with inductor's header an empty
kernel took ~0.35 s of CPU, ~85% of it "template instantiation", and our RNN kernel ~0.49 s.
Nothing in GCC's options makes it do them before the header is written, so a tiny GCC plugin
(``PLUGIN_SOURCE``, built with the compiler that builds the header) gives a pragma that calls GCC's
own ``instantiate_pending_templates``, written at the end of the header. With that header the same
kernel takes ~0.2 s of CPU and its object file is the same, byte for byte (the same functions are
instantiated from the same definitions, only earlier; the kernel's own uses still instantiate at
its end). Building the header costs ~5-8 s, once per compiler, flags and torch version, like
inductor's own: it is built in the background (niced, in its own session) the first time a kernel
asks for it, and that kernel (and any until it is ready) builds with inductor's header.

The header sits next to inductor's (``<inductor's name>.scan-<key>.h``; the key: the compile flags,
inductor's header line, the plugin's source), as a ``.gch`` beside an ``#error`` text: a kernel
whose compiler does not take the precompiled one stops at once and is built with inductor's
command (``kernel_build``, with a warning); a header that could not be built leaves a ``.failed``
file and is not tried again.
"""
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time

PRAGMA = "#pragma scan_pch instantiate"

# No GCC plugin headers needed: the names it uses are GCC's plugin API (``get_named_event_id``,
# ``register_callback``) and two functions of its C++ front end. The pragma says when it ran; a
# header whose build did not say so (another compiler, a GCC without plugins) is not used.
PLUGIN_SOURCE = r"""// torch_scan_hop: `#pragma scan_pch instantiate` instantiates the templates pending so far.
#include <cstdio>
struct cpp_reader;
struct plugin_name_args { char *base_name; };
struct plugin_gcc_version;
void instantiate_pending_templates(int);
void c_register_pragma(const char *, const char *, void (*)(cpp_reader *));
extern "C" int get_named_event_id(const char *, int /* insert_option: NO_INSERT */);
extern "C" void register_callback(const char *, int, void (*)(void *, void *), void *);
extern "C" { int plugin_is_GPL_compatible; }
static void instantiate(cpp_reader *) {
  instantiate_pending_templates(0);
  std::fputs("scan_pch: instantiated\n", stderr);
}
static void register_pragma(void *, void *) { c_register_pragma("scan_pch", "instantiate", instantiate); }
extern "C" int plugin_init(plugin_name_args *info, plugin_gcc_version *) {
  int event = get_named_event_id("PLUGIN_PRAGMAS", 0);
  if (event < 0) return 1;
  register_callback(info->base_name, event, register_pragma, nullptr);
  return 0;
}
"""

_NOT_USABLE = '#error "torch_scan_hop: this precompiled header was not usable here"\n'
_STALE_LOCK_S = 600
_started = {}  # our header's path -> its build (a Popen), or None where another process builds it
_lock = threading.Lock()
_asked = set()  # our headers kernels of this process asked for


def with_own_header(command):
    """``command`` (inductor's command line for a kernel) including our header instead of
    inductor's, or None: not a GCC command with one precompiled header, ours failed before, or ours
    is not built yet (its build is then started, once)."""
    parts = command.split(" ")
    at = [i for i, part in enumerate(parts[:-1]) if part == "-include"]
    if len(at) != 1:
        return None
    header = parts[at[0] + 1]
    if not header.endswith(".h") or not os.path.isfile(header + ".gch"):
        return None
    flags = header_flags(command)
    if flags is None:
        return None
    ours = own_header_path(header, flags)
    with _lock:  # kernels build on worker threads; ``ready`` reads the set
        _asked.add(ours)
    if os.path.isfile(ours + ".failed"):
        return None
    if os.path.isfile(ours) and os.path.isfile(ours + ".gch"):
        parts[at[0] + 1] = ours
        return " ".join(parts)
    start_building(header, ours, flags)
    return None


_WITH_VALUE = ("-D", "-U", "-I", "-isystem", "-iquote", "-idirafter", "-x")  # kept with their value
_DROPPED_WITH_VALUE = ("-o", "-include", "-L", "-l", "-Xlinker")
_LINK_ONLY = ("-shared", "-c")


def header_flags(command):
    """The compiler and flags of ``command`` that a header is built with (no source, output,
    included header, link or library options), or None where it names no ``-o``."""
    words = shlex.split(command)
    if "-o" not in words or len(words) < 2:
        return None
    kept, value = [words[0]], None
    for word in words[1:]:
        if value is not None:
            if value:
                kept.append(word)
            value = None
        elif word in _WITH_VALUE or word in _DROPPED_WITH_VALUE:
            value = word in _WITH_VALUE
            if value:
                kept.append(word)
        elif word in _LINK_ONLY or word.startswith(("-l", "-L", "-Wl,")) or not word.startswith("-"):
            continue  # a link option, or a source file
        else:
            kept.append(word)
    return kept


def own_header_path(header, flags):
    """Where our header for inductor's ``header`` built with ``flags`` is (next to inductor's)."""
    with open(header) as f:
        text = f.read()
    key = hashlib.sha256("\0".join([*flags, text, PRAGMA, PLUGIN_SOURCE]).encode()).hexdigest()[:16]
    return f"{header[:-len('.h')]}.scan-{key}.h"


def forget(ours_command):
    """Our header in ``ours_command`` did not serve: mark it failed (not tried again)."""
    parts = ours_command.split(" ")
    ours = parts[parts.index("-include") + 1]
    try:
        with open(ours + ".failed", "w") as f:
            f.write("a kernel did not build with it and did with inductor's header\n")
    except OSError:
        pass


_DONE = "scan_pch: instantiated"


def build_script(ours, flags, scratch):
    """The shell commands that build our header in ``scratch`` (holding ``plugin.cc`` and
    ``header.h``) and move it next to inductor's (the ``.gch``, then the ``#error`` text), or leave
    ``.failed`` (and the compiler's output in ``.log``)."""
    q = shlex.quote
    at = lambda name: q(os.path.join(scratch, name))  # noqa: E731
    plugin = " ".join([q(flags[0]), "-shared", "-fPIC", "-O1", at("plugin.cc"), "-o", at("plugin.so")])
    header = " ".join([*map(q, flags), "-fplugin=" + at("plugin.so"), "-x", "c++-header", at("header.h"),
                       "-o", at("header.h.gch")])
    steps = [
        plugin,
        f"{header} 2> {at('err')}",
        f"grep -q {q('^' + _DONE + '$')} {at('err')}",
        f"mv {at('header.h.gch')} {q(ours + '.gch.tmp')}",
        f"mv {q(ours + '.gch.tmp')} {q(ours + '.gch')}",
        f"printf %s {q(_NOT_USABLE)} > {q(ours + '.tmp')}",
        f"mv {q(ours + '.tmp')} {q(ours)}",
    ]
    log = q(ours + ".log")
    return (f"if ( {' && '.join(steps)} ) > {log} 2>&1; then rm -f {log}; "
            f"else cat {at('err')} >> {log}; touch {q(ours + '.failed')}; fi; rm -rf {q(scratch)} {q(ours + '.lock')}")


def wait_for_builds():
    """Wait for the header builds this process started (tests and benchmarks that want the
    header there before they measure or check)."""
    with _lock:
        builds = [build for build in _started.values() if build is not None]
    for build in builds:
        build.wait()


def ready(timeout_s=600):
    """Wait (up to ``timeout_s``) until every header this process's kernels asked for is built or
    failed, by this process or another; whether they are all built (and some was asked for)."""
    wait_for_builds()
    deadline = time.monotonic() + timeout_s
    with _lock:
        asked = sorted(_asked)
    while any(not (os.path.isfile(p) or os.path.isfile(p + ".failed")) for p in asked) and time.monotonic() < deadline:
        time.sleep(0.2)
    return bool(asked) and all(os.path.isfile(p) and os.path.isfile(p + ".gch") for p in asked)


def start_building(header, ours, flags):
    """Build our header ``ours`` for inductor's ``header`` with ``flags`` in the background (once
    per process, and by one process at a time: a lock file beside it)."""
    with _lock:
        if ours in _started:
            return
        _started[ours] = None
    if not _take_lock(ours + ".lock"):
        return
    try:
        scratch = tempfile.mkdtemp(prefix="scan_pch_")
        with open(os.path.join(scratch, "plugin.cc"), "w") as f:
            f.write(PLUGIN_SOURCE)
        with open(header) as f, open(os.path.join(scratch, "header.h"), "w") as g:
            g.write(f.read() + "\n" + PRAGMA + "\n")
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        build = subprocess.Popen([*nice, "sh", "-c", build_script(ours, flags, scratch)], env=os.environ.copy(),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError:
        _release(ours + ".lock")
        return
    with _lock:
        _started[ours] = build


def _take_lock(path):
    """Whether this process builds the header (another may be at it: its lock is younger than
    ``_STALE_LOCK_S``)."""
    try:
        if time.time() - os.path.getmtime(path) > _STALE_LOCK_S:
            os.remove(path)
    except OSError:
        pass
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return False
    return True


def _release(path):
    try:
        os.remove(path)
    except OSError:
        pass
