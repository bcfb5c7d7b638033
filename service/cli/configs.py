"""Model configs for `select --config`: a config.json, a model directory, a directory of
configs, or a Hugging Face repo id.

A repo id (`Org/Name`, optionally `Org/Name@revision`) is fetched with huggingface_hub's
`hf_hub_download`, so its cache and `HF_HUB_OFFLINE` work as everywhere else in the
ecosystem: an offline machine answers from the cache, and a repo never fetched fails with
the library's own reason. A local path always wins over a repo id of the same spelling.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.oracle import InvalidSpecError
from service.oracle.json_text import parse_json

CONFIG_FILE = "config.json"

#: `Org/Name` or `Org/Name@revision`, as the Hub spells repo ids.
_REPO_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model's config.json object, with the label a table shows for it and where it
    came from (a file path, or `hf://repo@revision`)."""

    label: str
    config: Any
    origin: str


def load_model_configs(
    sources: Sequence[str], *, field_name: str = "--config"
) -> list[ModelConfig]:
    """Every model named by `sources`, in order (a directory's in name order)."""
    models: list[ModelConfig] = []
    for source in sources:
        models.extend(_load(source, field_name))
    return models


def _load(source: str, field_name: str) -> Iterable[ModelConfig]:
    path = Path(source).expanduser()
    if path.is_file():
        return [_from_file(path, _file_label(path), field_name)]
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return [_from_file(path / CONFIG_FILE, path.resolve().name, field_name)]
        return _from_directory(path, field_name)
    match = _REPO_ID.match(source)
    if match is None or path.exists():
        raise InvalidSpecError.single(
            f"{field_name} {source}",
            "cannot read: no such file or directory (and not a Hugging Face repo id, "
            "Org/Name[@revision])",
        )
    return [_from_hub(match["repo"], match["revision"], field_name)]


def _file_label(path: Path) -> str:
    """A model directory's name for its config.json, else the file's stem."""
    return path.resolve().parent.name if path.name == CONFIG_FILE else path.stem


def _from_directory(directory: Path, field_name: str) -> list[ModelConfig]:
    """A directory of configs: its `*.json` files and its subdirectories' config.json."""
    found: list[ModelConfig] = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.suffix == ".json":
            found.append(_from_file(entry, entry.stem, field_name))
        elif entry.is_dir() and (entry / CONFIG_FILE).is_file():
            found.append(_from_file(entry / CONFIG_FILE, entry.name, field_name))
    if not found:
        raise InvalidSpecError.single(
            field_name,
            f"{str(directory)!r} holds no config.json, no *.json and no model directories",
        )
    return found


def _from_file(path: Path, label: str, field_name: str) -> ModelConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidSpecError.single(
            f"{field_name} {path}", f"cannot read: {exc.strerror}"
        ) from None
    except UnicodeDecodeError as exc:
        raise InvalidSpecError.single(f"{field_name} {path}", f"not UTF-8: {exc.reason}") from None
    config = parse_json(text, f"{field_name} {path}", numbers_at="config")
    return ModelConfig(label=label, config=config, origin=str(path))


def _from_hub(repo_id: str, revision: str | None, field_name: str) -> ModelConfig:
    """config.json of a Hub repo, through huggingface_hub (its cache, its offline mode)."""
    # Imported on first use: it is a large import, and only a repo id needs it.
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    where = f"{field_name} {repo_id}"
    try:
        local = hf_hub_download(repo_id, CONFIG_FILE, revision=revision)
    except HfHubHTTPError as exc:
        # Unknown repo, gated repo, no config.json, unknown revision: the Hub's own words.
        raise InvalidSpecError.single(where, _first_line(exc)) from None
    except EntryNotFoundError as exc:
        # Offline (HF_HUB_OFFLINE=1) or no network, and not in the cache.
        raise InvalidSpecError.single(where, f"not in the Hugging Face cache: {exc}") from None
    except OSError as exc:
        raise InvalidSpecError.single(where, _first_line(exc)) from None
    model = _from_file(Path(local), repo_id, field_name)
    origin = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    return ModelConfig(label=repo_id, config=model.config, origin=origin)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
