"""Model-hub ids (``org/name``) as model and tokenizer paths, resolved through ``huggingface_hub``.

A path that exists locally is always used as-is. A hub id is looked up in the local Hugging
Face cache first (``HF_HUB_CACHE`` / ``HF_HOME``, no network); a complete cached snapshot is
served as it is, even when online, so a cached model starts the same with or without a network.
Otherwise it is downloaded into that cache, with huggingface_hub's progress bars on stderr,
unless ``HF_HUB_OFFLINE`` is set; when that is impossible the path is refused, saying why.

Only what the loader reads is downloaded: the top-level json / tokenizer files and one weights
format (safetensors, else .bin, else a single .gguf), sharded weights limited to their index's
shards. ``org/name/file.gguf`` names one GGUF file of a repository.

huggingface_hub reads its environment when it is imported; the cache, the endpoint and offline
mode are read here at call time instead, so a process (or a test) can change them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import structlog

from core.errors import ModelLoadError

if TYPE_CHECKING:
    from core.engine.config import EngineArgs

log = structlog.get_logger("core.engine.model_loader.hub")

# org/name, optionally followed by the path of one .gguf file in the repository
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[\w./-]+\.gguf))?")
_META_SUFFIXES = (".json", ".jinja", ".model", ".tiktoken", ".txt")  # config, generation config, tokenizer files
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_INDEXES = {".safetensors": "model.safetensors.index.json", ".bin": "pytorch_model.bin.index.json"}


def is_hub_id(path: str | os.PathLike | None) -> bool:
    """A string shaped like ``org/name[/file.gguf]`` (a repository id the hub accepts) that is
    not an existing local path."""
    if not isinstance(path, str) or Path(path).expanduser().exists():
        return False
    m = _HUB_ID.fullmatch(path)
    # a missing "dir/model.gguf" is a mistyped local file, not a repository named like one
    if m is None or ".." in path or m["repo"].endswith(".gguf"):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, from the environment as it is now."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_path(path: str, *, revision: str | None = None, tokenizer: bool = False,
                     weights: bool = True, cache_dir: str | None = None) -> Path:
    """The local folder (or .gguf file) for hub id ``path``: cached, else downloaded.

    ``tokenizer``: only the tokenizer files are needed; ``weights=False`` (``--load-format
    dummy``): only config and tokenizer; ``cache_dir`` (``--download-dir``): the hub cache to
    look in and download into, instead of huggingface_hub's. Raises ModelLoadError saying why it
    cannot be had."""
    m = _HUB_ID.fullmatch(path)
    if m is None:
        raise ModelLoadError(f"{path!r} is not a model-hub id (org/name)")
    repo, file = m["repo"], m["file"]
    what = "tokenizer path" if tokenizer else "model path"
    cache = Path(cache_dir).expanduser() if cache_dir else hub_cache_dir()
    where = f"--download-dir {cache}" if cache_dir else f"HF_HUB_CACHE={cache}"
    folder = _cached_snapshot(repo, revision, cache)
    if folder is not None and _complete(folder, file, tokenizer, weights):
        log.info("hub.cached", repo=repo, revision=revision or "main", path=str(folder))
        return folder / file if file else folder
    refusal = (f"{what} {path!r} does not exist locally and is not{' completely' if folder else ''} in the local "
               f"Hugging Face cache ({where})")
    if hub_offline():
        raise ModelLoadError(f"{refusal}; HF_HUB_OFFLINE is set, so it was not downloaded: pass a local folder or "
                             f".gguf file, or unset HF_HUB_OFFLINE")
    try:
        folder = _download(repo, revision, cache, file, tokenizer, weights)
    except Exception as e:  # network, authentication, missing repository, revision or weights, disk
        raise ModelLoadError(f"{refusal} and could not be downloaded: {_reason(e)}") from e
    return folder / file if file else folder


def resolve_hub_args(args: EngineArgs) -> EngineArgs:
    """``EngineArgs`` with a hub-id ``model_path`` / ``tokenizer_path`` replaced by local paths,
    once, before any rank or replica starts (they then share one download). The served model
    name stays the hub id, as in SGLang; ``revision`` applies to the model (and to a tokenizer
    path naming the same repository)."""
    changes: dict[str, str] = {}
    if is_hub_id(args.model_path):
        local = resolve_hub_path(args.model_path, revision=args.revision, weights=args.load_format != "dummy",
                                 cache_dir=args.download_dir)
        changes.update(model_path=str(local), served_model_name=args.served_model_name or args.model_path)
    if is_hub_id(args.tokenizer_path):
        revision = args.revision if args.tokenizer_path == args.model_path else None
        changes["tokenizer_path"] = str(resolve_hub_path(args.tokenizer_path, revision=revision, tokenizer=True,
                                                         cache_dir=args.download_dir))
    return attrs.evolve(args, **changes) if changes else args


def _cached_snapshot(repo: str, revision: str | None, cache: Path) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:  # not cached, or a cached listing shows files missing
        return None


def _complete(folder: Path, file: str | None, tokenizer: bool, weights: bool) -> bool:
    """Whether a cached snapshot holds what the loader reads (an earlier partial download,
    or a config fetched by another tool, is not enough)."""
    if file:
        return (folder / file).is_file()
    if tokenizer:
        return any((folder / f).is_file() for f in _TOKENIZER_FILES)
    has_config = (folder / "config.json").is_file()
    if not weights:
        return has_config
    if not has_config:
        return len(list(folder.glob("*.gguf"))) == 1  # a GGUF-only repository
    for suffix, index in _INDEXES.items():
        if (folder / index).is_file():
            return all((folder / f).is_file() for f in _shards(folder / index))
        if any(folder.glob("*" + suffix)):
            return True
    return False


def _download(repo: str, revision: str | None, cache: Path, file: str | None, tokenizer: bool, weights: bool) -> Path:
    """Download what the loader needs into ``cache``; the snapshot folder."""
    from huggingface_hub import HfApi, snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT") or None
    info = HfApi(endpoint=endpoint).model_info(repo, revision=revision)
    files = [s.rfilename for s in info.siblings or ()]
    top = [f for f in files if "/" not in f]
    meta = [f for f in top if f.endswith(_META_SUFFIXES)]

    def fetch(patterns: list[str]) -> Path:
        # the branch or tag, not info.sha: snapshot_download records refs/<revision> only then, and the
        # next start finds the snapshot in the cache through that ref
        log.info("hub.download", repo=repo, revision=revision or "main", files=len(patterns), cache=str(cache))
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, endpoint=endpoint,
                                      allow_patterns=patterns))

    if file:
        if file not in files:
            raise ModelLoadError(f"the repository has no file {file!r}")
        return fetch(meta + [file])
    if tokenizer or not weights:
        return fetch(meta)
    # a weights index (in the small files, fetched first) names the shards to fetch
    folder = fetch(meta) if any(index in top for index in _INDEXES.values()) else None
    return fetch(meta + _pick_weights(top, folder))


def _pick_weights(top: list[str], folder: Path | None) -> list[str]:
    """One weights format of the repository's top-level files, as the loader reads them
    (``folder``: where the index files were fetched, if there are any)."""
    for suffix, index in _INDEXES.items():
        if index in top and folder is not None:
            return sorted(_shards(folder / index))
        found = [f for f in top if f.endswith(suffix) and "training_args" not in f]
        if found:
            return found
    ggufs = [f for f in top if f.endswith(".gguf")]
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        raise ModelLoadError(f"it holds {len(ggufs)} .gguf files; name one as org/name/<file>.gguf "
                             f"({', '.join(sorted(ggufs)[:4])}{', ...' if len(ggufs) > 4 else ''})")
    raise ModelLoadError("it holds no *.safetensors, *.bin or .gguf weights at its top level")


def _shards(index: Path) -> set[str]:
    try:
        return set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ModelLoadError(f"cannot read the weights index {index.name}: {e}") from None


def _reason(e: Exception) -> str:
    """One line on why a hub call failed (huggingface_hub's messages run to several lines)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, ModelLoadError):  # ours: the repository holds nothing the loader can read
        return str(e)
    if isinstance(e, GatedRepoError):
        return "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return "no such repository on the hub (or it is private: set HF_TOKEN)"
    if isinstance(e, RevisionNotFoundError):
        return "no such revision in the repository"
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else 'no details'}"
