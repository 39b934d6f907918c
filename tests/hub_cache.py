"""A Hugging Face hub cache laid out as huggingface_hub writes it, built from local files (no network)."""

from __future__ import annotations

from pathlib import Path

from meshserve.demo_model import DEMO_MODEL_DIR

MAIN = "1" * 40
OLD = "2" * 40
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def hub_cache(root: Path, repo: str = "acme/pydoc-llama", *, source: Path = DEMO_MODEL_DIR,
              files: tuple[str, ...] = CONFIG_FILES) -> Path:
    """`root`/models--org--name with `repo` at two commits: main and tag v1 -> MAIN, branch old -> OLD.
    Blobs are symbolic links to the files of `source` (nothing is copied)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    for commit in (MAIN, OLD):
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True)
        for name in files:
            blob = folder / "blobs" / f"{commit[:8]}-{name}"
            blob.parent.mkdir(exist_ok=True)
            blob.symlink_to(Path(source, name).resolve())
            (snap / name).symlink_to(blob)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(MAIN)
    (folder / "refs" / "old").write_text(OLD)
    (folder / "refs" / "v1").write_text(MAIN)
    return folder
