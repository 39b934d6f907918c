"""A faster Triton interpreter for the CPU suite: a device-function call inside a kernel launch no
longer re-patches the language modules that the launch has already patched.

Under TRITON_INTERPRET=1, every launch (`GridExecutor.__call__`) swaps triton.language's builtins
for interpreted ones, runs every program of the grid, then restores them. Every call of a
@triton.jit helper from inside a kernel (`InterpretedFunction.__call__`: our kernels' softmax
steps, key ranges, tile loads) patches the same modules again, for every program: an
`inspect.getmembers` walk over four modules whose result changes nothing, since each builtin was
already replaced by the launch. That walk was a third to a half of the interpreter's time in
the attention tests (py-spy, tests/unit/workers/test_decode_graphs.py and test_dcp_reference.py).

`skip_repeated_patching()` skips that second patch when, and only when, this thread is inside a
launch that patched every language module the helper sees and those modules are still patched
(no other thread's launch restored them meanwhile: then the original patch runs, as before). The
kernels run the same interpreted operations either way; tests/unit/attention/
test_triton_interpreter_hook.py checks a kernel with nested helpers gives identical results with
and without it. Triton versions whose interpreter lacks these internals are left untouched.
"""

from __future__ import annotations

import contextlib
import threading

_launches = threading.local()  # per thread: a stack of the language modules each active launch patched
_installed: dict[str, object] = {}


def _language_modules(fn) -> tuple:
    """The triton.language modules visible to `fn` (what the interpreter's _patch_lang patches for it)."""
    import triton.language as tl

    return tuple(value for value in fn.__globals__.values() if value is tl or value is tl.core)


def skip_repeated_patching() -> bool:
    """Install the hook (idempotent); False where this Triton's interpreter has other internals."""
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not all(hasattr(x, name) for x, name in ((interpreter, "_patch_lang"), (interpreter, "GridExecutor"),
                                                (interpreter, "InterpretedFunction"), (tl.core, "is_builtin"))):
        return False
    original_patch, original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    modules_of: dict[object, tuple] = {}

    def patch_lang(fn):
        stack = getattr(_launches, "stack", None)
        langs = modules_of.get(fn)
        if langs is None:
            langs = modules_of[fn] = _language_modules(fn)
        if stack and langs and all(id(m) in stack[-1] and not tl.core.is_builtin(m.load) for m in langs):
            return None  # a device-function call: InterpretedFunction.__call__ ignores the scope
        scope = original_patch(fn)
        if stack:
            stack[-1].update(id(m) for m in langs)
        return scope

    def launch(self, *args, **kwargs):
        stack = _launches.__dict__.setdefault("stack", [])
        stack.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            stack.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    _installed.update(patch_lang=original_patch, launch=original_launch)
    return True


@contextlib.contextmanager
def without_the_hook():
    """The interpreter as Triton ships it, for the block (the hook's own test compares both)."""
    from triton.runtime import interpreter

    if not _installed:
        yield
        return
    hooked = interpreter._patch_lang, interpreter.GridExecutor.__call__
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = _installed["patch_lang"], _installed["launch"]
    try:
        yield
    finally:
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = hooked
