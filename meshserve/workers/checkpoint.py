"""An HF checkpoint directory: config.json, *.safetensors (single or sharded by an index), tokenizer.

Tensors are read through safetensors' memory map, one slice at a time: a tensor-parallel rank
touches only the bytes of its own shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshserve.core.checkpoint_files import read_json
from meshserve.errors import check
from meshserve.workers.models.arch import ModelArch, arch_from_hf_config

INDEX_FILE = "model.safetensors.index.json"


def read_arch(model_dir: str | Path) -> ModelArch:
    """The architecture of the checkpoint in `model_dir`, with EOS ids from generation_config.json."""
    model_dir = Path(model_dir)
    check(model_dir.is_dir(), "model", str(model_dir), "an existing checkpoint directory")
    arch = arch_from_hf_config(read_json(model_dir / "config.json", "model"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path, "model")
        extra = gen.get("eos_token_id")
        extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
        eos = tuple(dict.fromkeys([*arch.eos_token_ids, *map(int, extra)]))
        from dataclasses import replace

        arch = replace(arch, eos_token_ids=eos)
    return arch


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by the sharded index, else every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "model").get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        for f in files:
            check(f.is_file(), "model", str(f), f"a file present as listed in {INDEX_FILE}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    check(bool(files), "model", str(model_dir), "a directory holding *.safetensors weights")
    return files


class Checkpoint:
    """Open weight files of one checkpoint; use as a context manager.

    `names()` lists every tensor; `read(name, dim, start, stop)` returns the slice
    [start:stop] along `dim` (or the whole tensor when dim is None) as a CPU tensor.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = safetensors_files(self.model_dir)
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}

    def __enter__(self) -> Checkpoint:
        for path in self.files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():
                self._where[name] = handle
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._where.clear()

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.read_box(name, {} if dim is None else {dim: (start, stop)})

    def read_box(self, name: str, box: dict[int, tuple[int, int | None]]) -> torch.Tensor:
        """Tensor `name` sliced [start:stop] along each dim of `box` (only that part is read)."""
        view = self._where[name].get_slice(name)
        if not box:
            return view[:]
        index = [slice(None)] * len(view.get_shape())
        for dim, (start, stop) in box.items():
            index[dim] = slice(start, stop)
        return view[tuple(index)]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.read(name)
