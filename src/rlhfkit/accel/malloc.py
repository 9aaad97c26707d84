"""Run the command line under another malloc (``accel.malloc``): tcmalloc or jemalloc in place of
the C library's, through ``LD_PRELOAD``.

On a CPU every tensor's memory comes from ``malloc``. glibc's keeps the blocks a training step
frees between blocks still alive as holes in its heap, resident until the heap's top is free, so
the resident set of an update stays well above the tensors alive (2 GiB of 8 on SmolLM2-135M's
GRPO step with 512-token completions, ``benchmarks/RESULTS.md``). tcmalloc reuses freed page
spans and hands idle ones back to the system as it goes. The preload must be in the environment
before the process starts, so the command line restarts itself once (``os.execve``: the same
process id, arguments and environment plus ``LD_PRELOAD``) before it imports torch; a notebook
or script sets ``LD_PRELOAD`` itself. No torch import here: this runs first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# name -> the libraries' link names (ldconfig's), tried in order
LIBRARIES = {"tcmalloc": ("tcmalloc_minimal", "tcmalloc"), "jemalloc": ("jemalloc",)}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4 (Debian, Ubuntu), gperftools-libs (Fedora)",
            "jemalloc": "libjemalloc2 (Debian, Ubuntu), jemalloc (Fedora)"}
_RESTARTED = "RLHFKIT_MALLOC_RESTARTED"  # set across the one restart: never loop


def resolve(name: str) -> str:
    """What ``LD_PRELOAD`` gets for ``accel.malloc = name``: a library's file name as the dynamic
    loader finds it (``libtcmalloc_minimal.so.4``), or the path given. ValueError naming the
    package to install when it is not found."""
    if os.sep in name:
        if not os.path.isfile(name):
            raise ValueError(f"accel.malloc: no such file {name!r}")
        return os.path.abspath(name)
    if name not in LIBRARIES:
        raise ValueError(f"accel.malloc must be '', {', '.join(map(repr, LIBRARIES))} or a path to a shared library, not {name!r}")
    if not sys.platform.startswith("linux"):
        raise ValueError("accel.malloc needs Linux (LD_PRELOAD and the glibc loader)")
    for link in LIBRARIES[name]:
        found = ctypes.util.find_library(link)
        if found:
            return found
    raise ValueError(f"accel.malloc={name}: the library is not installed; install {PACKAGES[name]}")


def loaded(lib: str) -> bool:
    """Is ``lib`` (a loader name or path) preloaded in this process: in ``LD_PRELOAD`` and mapped."""
    names = {os.path.basename(p) for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()}
    if os.path.basename(lib) not in names:  # a path the user preloaded counts for its file name
        return False
    try:
        ctypes.CDLL(lib, mode=os.RTLD_NOLOAD)  # raises when the library is not in the process
    except OSError:
        return False
    return True


def restart_with(name: str, command: str, argv: list[str] | None) -> None:
    """Make sure this process runs with malloc ``name`` preloaded: return at once when it does
    (or ``name`` is empty), else restart the command line as ``python -m rlhfkit ARGV`` with it in
    ``LD_PRELOAD`` (this call does not return). ValueError when the library is missing, the
    restart did not load it, or ``argv`` is None (called as a function: no command line to restart)."""
    if not name:
        return
    lib = resolve(name)
    if loaded(lib):
        os.environ.pop(_RESTARTED, None)  # a command this one starts may restart for its own accel.malloc
        print(f"rlhfkit {command}: malloc: {lib} (accel.malloc={name})", file=sys.stderr, flush=True)
        return
    if argv is None:
        raise ValueError(f"accel.malloc={name} restarts the `rlhfkit` command with LD_PRELOAD; called as a "
                         f"function, set LD_PRELOAD={lib} before Python starts instead")
    if os.environ.get(_RESTARTED):
        raise ValueError(f"accel.malloc={name}: {lib} was not preloaded after the restart (LD_PRELOAD="
                         f"{os.environ.get('LD_PRELOAD', '')!r}); the dynamic loader's message is above")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join([lib, *env.get("LD_PRELOAD", "").replace(":", " ").split()])
    env[_RESTARTED] = "1"
    # tcmalloc reports every allocation over 1 GiB on stderr by default (a model's embedding can be
    # one): quiet unless the user asked for a threshold
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "rlhfkit", *argv], env)
