"""`--model`: a checkpoint folder, or a Hugging Face model id resolved through huggingface_hub.

`org/name` (optionally at `--revision`: a branch, tag or commit) becomes the folder of its
snapshot in the hub cache (HF_HUB_CACHE / HF_HOME, shared with transformers and vLLM). With
HF_HUB_OFFLINE=1 only the cache is read; online, missing files are downloaded with a progress
bar (only what serving needs: configs, tokenizer files, safetensors weights, chat templates).
An existing local folder always wins over an id of the same spelling.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshserve.errors import ConfigError, check

# What a checkpoint folder needs; .bin/.pt/.msgpack/.h5 weights and READMEs/images are left on the hub.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_model_id(model: str) -> bool:
    return _REPO_ID.fullmatch(model) is not None and ".." not in model


def resolve_model(model: str | Path, *, revision: str | None = None, progress: bool = True,
                  cache_dir: str | Path | None = None) -> str:
    """The local checkpoint folder for `model` (a folder, or a hub id at `revision`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        check(revision is None, "revision", revision, "unset when --model is a local folder")
        return str(path)
    name = str(model)
    check(is_model_id(name), "model", name, "an existing checkpoint directory or a Hugging Face model id 'org/name'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub_errors
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    offline = constants.HF_HUB_OFFLINE
    where = f"{name!r}" + (f" at revision {revision!r}" if revision else "")
    (enable_progress_bars if progress else disable_progress_bars)()
    try:
        folder = snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS,
                                   local_files_only=offline)
    except hub_errors.RevisionNotFoundError:
        raise ConfigError("revision", revision, f"a branch, tag or commit of {name!r}") from None
    except hub_errors.GatedRepoError:
        raise ConfigError("model", name, "a model this machine may download (it is gated: accept its licence "
                                         "on huggingface.co and set HF_TOKEN)") from None
    except hub_errors.RepositoryNotFoundError:
        raise ConfigError("model", name, "a model id on the Hugging Face hub (not found; a private one needs "
                                         "HF_TOKEN), or an existing local folder") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.HfHubHTTPError, OSError, ValueError) as exc:
        why = ("HF_HUB_OFFLINE is set and the hub cache has no snapshot of it" if offline
               else f"the download failed: {type(exc).__name__}: {exc}")
        raise ConfigError("model", name, f"a model id whose files can be had ({where}: {why}); "
                                         "or an existing local folder") from None
    check((Path(folder) / "config.json").is_file(), "model", name,
          f"a Hugging Face checkpoint with a config.json (the snapshot at {folder} has none)")
    return folder
