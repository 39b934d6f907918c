"""Repack the flashinfer-python 0.7.x wheel to what Hopper (sm90) attention needs, so that it fits
the 64 MiB a device call carries (the 0.7.4 wheel is 101 MB: Blackwell/sm120 sources, MoE, comm,
training kernels, an `experimental` tree).

    python bench/repack_flashinfer.py flashinfer_python-0.7.4-py3-none-any.whl --out .whl/ [--mode jit|aot]

What stays:
- Python: every module `import flashinfer` loads (a static closure over module-level imports,
  from flashinfer/__init__.py), plus every import — function-level ones too — of the modules our
  FLASHINFER backends call (prefill, decode, mla, page, cascade) and of the JIT machinery
  (flashinfer/jit/core, cpp_ext, env, attention/*), which import lazily inside functions.
- --mode jit (default): the sources an sm90 build of our modules compiles — the JIT generators in
  flashinfer/jit/attention/modules.py read batch_prefill*/batch_decode*/batch_mla* (FA2 and the
  *_sm90 FA3 variants, FP8 included) and single_* templates from data/csrc, plus csrc's top-level
  headers; and the include trees every build puts on its path (data/include, cutlass,
  cccl, spdlog). Dropped: csrc subfolders (trtllm-gen, fmha_v2, cake_*, fused_moe, gdn, kda ...)
  and top-level csrc files of other families (sm100/sm120 GEMMs, cutlass MLA, xqa, comm, MoE).
- --mode aot: Python only, no data/ at all, for a device that loads prebuilt modules
  (bench/flashinfer_aot.sh writes them into fi07_cache.tgz as flashinfer/data/aot/<name>/<name>.so).

The wheel keeps its name and version (pip installs it as flashinfer-python 0.7.4); its RECORD is
rewritten for the files kept (bench/wheel_repack.py). Prints the size of what it wrote.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile
from pathlib import Path, PurePosixPath

try:  # `python bench/repack_flashinfer.py` puts bench/ on the path, `python -m bench.repack_flashinfer` the repository
    import wheel_repack
except ModuleNotFoundError:
    from bench import wheel_repack

PKG = "flashinfer"
# Modules our backends call, whose function-level imports are followed too.
DEEP_SEEDS = (
    "flashinfer.prefill", "flashinfer.decode", "flashinfer.page", "flashinfer.cascade", "flashinfer.utils",
    "flashinfer.mla", "flashinfer.mla._core", "flashinfer.mla._batch_mla._wrapper",
    "flashinfer.mla._batch_mla._auto_policy", "flashinfer.mla._batch_mla._backends._fa_common",
    "flashinfer.mla._batch_mla._backends.fa2_backend", "flashinfer.mla._batch_mla._backends.fa3_backend",
    "flashinfer.jit", "flashinfer.jit.core", "flashinfer.jit.cpp_ext", "flashinfer.jit.env",
    "flashinfer.jit.utils", "flashinfer.jit.attention", "flashinfer.jit.attention.modules",
    "flashinfer.jit.attention.utils", "flashinfer.jit.attention.variants", "flashinfer.jit.mla",
    "flashinfer.jit.page", "flashinfer.jit.cascade", "flashinfer.aot", "flashinfer.compilation_context",
)  # fmt: skip
# data/csrc top-level files the sm90 attention generators compile (FA2, FA3 = *_sm90, FP8 FA3).
CSRC_KEEP = re.compile(
    r"^(batch_prefill|batch_decode|batch_mla|single_prefill|single_decode|page|cascade|"
    r"flashinfer_page_binding|flashinfer_cascade_binding|logging)[^/]*$|^[^/]*\.(h|cuh|inc)$"
)
CSRC_DROP = re.compile(r"(sm100|sm103|sm110|sm120|sm10x|blackwell|trtllm|cute_sm80|cake_|alltoall|nvlink|ulysses)")
INCLUDE_TREES = ("data/include/", "data/cutlass/include/", "data/cutlass/tools/util/include/", "data/cccl/",
                 "data/spdlog/include/")  # fmt: skip


def module_of(path: str) -> str | None:
    """'flashinfer/mla/_core.py' -> 'flashinfer.mla._core'; packages map to their __init__."""
    if not path.endswith(".py"):
        return None
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(module: str, source: str, is_package: bool, *, deep: bool) -> set[str]:
    """flashinfer modules `source` imports: module-level only, or every import when `deep`."""
    tree = ast.parse(source)
    nodes = ast.walk(tree) if deep else _module_level(tree.body)
    out: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == PKG}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG:
                continue
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from . import x` may name a module
    return out


def _module_level(body: list[ast.stmt]):
    """Statements run at import: the body, and the bodies of its if/try/with blocks (not defs)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)):
                yield from _module_level([n for n in inner if isinstance(n, ast.stmt)] + [
                    s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body])


def python_closure(files: dict[str, bytes], *, all_deep: bool = False) -> set[str]:
    """Paths of the .py files to keep (all_deep: follow function-level imports everywhere)."""
    by_module = {m: p for p in files if (m := module_of(p))}
    keep: set[str] = set()
    todo = [(PKG, False)] + [(m, True) for m in DEEP_SEEDS]
    seen: set[tuple[str, bool]] = set()
    while todo:
        module, deep = todo.pop()
        if (module, deep) in seen:
            continue
        seen.add((module, deep))
        path = by_module.get(module)
        if path is None:
            continue
        keep.add(path)
        parts = module.split(".")
        for i in range(1, len(parts)):  # parent packages run their __init__ first
            todo.append((".".join(parts[:i]), False))
        source = files[path].decode()
        for target in imports_of(module, source, path.endswith("__init__.py"), deep=deep or all_deep):
            todo.append((target, all_deep))
    return keep


def keep_data(path: str) -> bool:
    rel = path[len(PKG) + 1:]
    if rel.startswith("data/csrc/"):
        name = rel[len("data/csrc/"):]
        return bool(CSRC_KEEP.match(name)) and not CSRC_DROP.search(name)
    return rel.startswith(INCLUDE_TREES)


def repack(src: str, out_dir: str, mode: str, *, all_deep: bool = False) -> str:
    zin = zipfile.ZipFile(src)
    files = {i.filename: zin.read(i) for i in zin.infolist() if not i.is_dir()}
    dist_info = next(p.split("/")[0] for p in files if p.split("/")[0].endswith(".dist-info"))
    py_keep = python_closure(files, all_deep=all_deep)
    kept: dict[str, bytes] = {}
    for path, data in files.items():
        if path.startswith(dist_info + "/"):
            if not path.endswith("/RECORD"):
                kept[path] = data
        elif path.startswith(PKG + "/"):
            if path in py_keep or path.endswith(("py.typed", "_build_meta.py", "version.py")):
                kept[path] = data
            elif path.endswith(".json") and "/data/" not in path and mode == "jit":
                kept[path] = data  # tuning tables beside the modules (small)
            elif mode == "jit" and "/data/" in path and keep_data(path):
                kept[path] = data
    out = wheel_repack.write_wheel(kept, f"{out_dir.rstrip('/')}/{PurePosixPath(src).name}",
                                   compression=zipfile.ZIP_DEFLATED, compresslevel=9)
    n_py = sum(p.endswith(".py") for p in kept)
    print(f"{src}: {len(files)} files -> {len(kept)} ({n_py} .py), mode {mode}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", help="flashinfer_python-0.7.x-py3-none-any.whl")
    ap.add_argument("--out", required=True, help="folder for the repacked wheel (same file name)")
    ap.add_argument("--mode", choices=("jit", "aot"), default="jit",
                    help="jit: sources and headers for sm90 builds; aot: Python only (prebuilt modules)")
    ap.add_argument("--deep", action="store_true", help="follow function-level imports of every kept module "
                    "(about 4.6 MB more; for a ModuleNotFoundError from a lazy import on the device)")
    args = ap.parse_args(argv)
    if Path(args.wheel).resolve() == (Path(args.out) / Path(args.wheel).name).resolve():
        sys.exit("--out must not be the folder the wheel is in (the name stays the same)")
    out = repack(args.wheel, args.out, args.mode, all_deep=args.deep)
    print(f"wrote {out}: {Path(out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
