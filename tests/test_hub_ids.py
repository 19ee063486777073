"""Model-hub ids (``org/name``) as model and tokenizer paths (core.engine.model_loader.hub): served from a
Hugging Face cache built on disk here (HF_HUB_OFFLINE or not), refused with a clear message when
not cached and offline or not downloadable, and never a reason to touch the network: every
test runs under a guard that fails on a connection to anything but the loopback address."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from core.engine.model_loader.hub import is_hub_id, resolve_hub_args, resolve_hub_path
from core.engine.model_loader.loader import resolve_model_path
from core.errors import ModelLoadError
from tests.conftest import greedy, make_engine

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture(autouse=True)
def connections(monkeypatch) -> list:
    """Every socket connect, recorded; one to a non-loopback address fails the test."""
    made: list = []
    real = socket.socket.connect

    def connect(self, address):
        made.append(address)
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"test tried to reach {address}")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return made


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, pointed to by HF_HUB_CACHE; online mode, with an endpoint nobody serves."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed local port: never the real hub
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at its import
    return cache


def cache_repo(cache: Path, repo: str, src: Path, *, ref: str = "main", commit: str = COMMIT,
               only: tuple[str, ...] | None = None) -> Path:
    """Put ``src``'s files into ``cache`` as huggingface_hub lays out a download: blobs named by
    content hash, the snapshot's files symlinks to them, ``refs/<ref>`` naming the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if (only is not None and f.name not in only) or (snapshot / f.name).exists():
            continue
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


# --------------------------------------------------------------------------- cached: served


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_cached_hub_id_is_served_from_the_cache(hf_cache, tiny_llama, monkeypatch, connections, offline):
    src, _ = tiny_llama()
    snapshot = cache_repo(hf_cache, "org/tiny", src)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hub_path("org/tiny") == snapshot
    assert resolve_model_path("org/tiny")[0] == snapshot
    eng = make_engine("org/tiny")
    try:
        out = eng.generate("hello", greedy(3))
        assert out["meta_info"]["completion_tokens"] == 3
        mc = eng.engine.model_config
        assert mc.path == snapshot and mc.served_name == "org/tiny"  # the name the API reports: the hub id
        other = cache_repo(hf_cache, "org/tiny-v2", src)
        assert eng._call(eng.engine.update_weights_from_disk("org/tiny-v2"))[0] is True  # the same resolver
        assert eng.engine.model_config.path == other
        assert connections == []  # a cached model needs no network, online or not
        ok, msg = eng._call(eng.engine.update_weights_from_disk("org/missing"))
        assert not ok and "not in the local Hugging Face cache" in msg
    finally:
        eng.shutdown()


def test_revision_picks_the_snapshot_of_a_branch_or_commit(hf_cache, tiny_llama):
    src, _ = tiny_llama()
    main = cache_repo(hf_cache, "org/tiny", src)
    v1 = cache_repo(hf_cache, "org/tiny", src, ref="v1", commit=OTHER_COMMIT)
    assert resolve_hub_path("org/tiny") == main
    assert resolve_hub_path("org/tiny", revision="v1") == v1
    assert resolve_hub_path("org/tiny", revision=OTHER_COMMIT) == v1


def test_tokenizer_path_and_served_name_resolve_through_the_same_resolver(hf_cache, tiny_llama):
    from core.engine.config import EngineArgs

    src, _ = tiny_llama()
    model = cache_repo(hf_cache, "org/tiny", src)
    tok = cache_repo(hf_cache, "org/tok", src, only=("tokenizer.json", "tokenizer_config.json"))
    args = resolve_hub_args(EngineArgs(model_path="org/tiny", tokenizer_path="org/tok"))
    assert (args.model_path, args.tokenizer_path, args.served_model_name) == (str(model), str(tok), "org/tiny")
    named = resolve_hub_args(EngineArgs(model_path="org/tiny", served_model_name="mine"))
    assert named.served_model_name == "mine"


def test_download_dir_is_the_cache_hub_ids_resolve_in(hf_cache, tiny_llama, tmp_path, monkeypatch):
    """SGLang's ``--download-dir``: the model and tokenizer ids are looked up in (and downloaded
    into) that folder instead of HF_HUB_CACHE; a weight update from disk uses it too."""
    from core.engine.config import EngineArgs

    src, _ = tiny_llama()
    mine = tmp_path / "mine"
    model = cache_repo(mine, "org/tiny", src)
    args = resolve_hub_args(EngineArgs(model_path="org/tiny", tokenizer_path="org/tiny", download_dir=str(mine)))
    assert (args.model_path, args.tokenizer_path) == (str(model), str(model))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"HF_HUB_CACHE="):  # (not in the default cache)
        resolve_hub_args(EngineArgs(model_path="org/tiny"))
    with pytest.raises(ModelLoadError, match=rf"--download-dir {mine}"):
        resolve_hub_path("org/other", cache_dir=str(mine))
    eng = make_engine("org/tiny", download_dir=str(mine))
    try:
        other = cache_repo(mine, "org/tiny-v2", src)
        assert eng._call(eng.engine.update_weights_from_disk("org/tiny-v2"))[0] is True
        assert eng.engine.model_config.path == other
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- not cached: refused


def test_uncached_id_offline_is_refused_without_a_network_attempt(hf_cache, monkeypatch, connections):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("org/missing")
    msg = str(e.value)
    assert "'org/missing' does not exist locally and is not in the local Hugging Face cache" in msg
    assert f"HF_HUB_CACHE={hf_cache}" in msg and "HF_HUB_OFFLINE is set" in msg
    assert connections == []


def test_partly_cached_id_offline_is_refused(hf_cache, tiny_llama, monkeypatch):
    src, _ = tiny_llama()
    cache_repo(hf_cache, "org/tiny", src, only=("config.json",))  # e.g. a config fetched by another tool
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="is not completely in the local Hugging Face cache"):
        resolve_hub_path("org/tiny")
    assert resolve_hub_path("org/tiny", weights=False).is_dir()  # --load-format dummy needs only the config


def test_uncached_id_that_cannot_be_downloaded_is_refused_naming_why(hf_cache, connections):
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("org/missing")
    msg = str(e.value)
    assert "'org/missing' does not exist locally and is not in the local Hugging Face cache" in msg
    assert "could not be downloaded: ConnectError" in msg and "refused" in msg
    assert connections and all(a[:2] == ("127.0.0.1", 9) for a in connections)


def test_a_missing_path_that_is_no_hub_id_says_so(tmp_path):
    for path in (tmp_path / "missing", "models/missing.gguf", "./org/name", "org/name.", "a--b/c"):
        assert not is_hub_id(str(path))
        with pytest.raises(ModelLoadError, match="does not exist$"):
            resolve_model_path(path)


# --------------------------------------------------------------------------- downloads (hub faked)


def fake_hub(monkeypatch, cache: Path, files: dict[str, bytes]) -> list[list[str]]:
    """huggingface_hub's calls answered from ``files``: model_info lists them, snapshot_download
    "downloads" the allowed ones into ``cache``; returns the allow_patterns of each download."""
    import huggingface_hub

    real = huggingface_hub.snapshot_download
    calls: list[list[str]] = []

    class Info:
        sha = COMMIT
        siblings = [type("Sibling", (), {"rfilename": name}) for name in files]

    def snapshot_download(repo_id, *, local_files_only=False, allow_patterns=None, **kw):
        if local_files_only:  # the real cache lookup
            return real(repo_id, local_files_only=True, **kw)
        calls.append(list(allow_patterns))
        src = cache.parent / "src"
        src.mkdir(exist_ok=True)
        for name in allow_patterns:
            (src / name).write_bytes(files[name])
        return str(cache_repo(cache, repo_id, src, only=tuple(allow_patterns)))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, revision=None: Info())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_download_fetches_only_what_the_loader_reads(hf_cache, monkeypatch):
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    calls = fake_hub(monkeypatch, hf_cache, {
        "config.json": b"{}", "tokenizer.json": b"{}", "model.safetensors.index.json": index, "README.md": b"",
        "model-00001-of-00002.safetensors": b"", "model-00002-of-00002.safetensors": b"",
        "consolidated.safetensors": b"", "pytorch_model.bin": b"", "original/consolidated.00.pth": b"",
    })
    folder = resolve_hub_path("org/big")
    assert calls[0] == ["config.json", "tokenizer.json", "model.safetensors.index.json"]  # the index first
    assert sorted(calls[-1]) == sorted(calls[0] + ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"])
    assert (folder / "model-00002-of-00002.safetensors").is_file()
    n = len(calls)
    assert resolve_hub_path("org/big") == folder and len(calls) == n  # the second start: from the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hub_path("org/big") == folder


@pytest.mark.parametrize("files,expected", [
    ({"config.json": b"{}", "pytorch_model.bin": b"", "training_args.bin": b""}, ["config.json", "pytorch_model.bin"]),
    ({"config.json": b"{}", "model.safetensors": b"", "pytorch_model.bin": b""}, ["config.json", "model.safetensors"]),
    ({"README.md": b"", "m.Q4_K_M.gguf": b""}, ["m.Q4_K_M.gguf"]),
])
def test_download_picks_one_weights_format(hf_cache, monkeypatch, files, expected):
    calls = fake_hub(monkeypatch, hf_cache, files)
    resolve_hub_path("org/m")
    assert calls == [expected]


def test_gguf_repositories(hf_cache, monkeypatch):
    calls = fake_hub(monkeypatch, hf_cache, {"a.Q4.gguf": b"", "a.Q8.gguf": b"", "config.json": b"{}"})
    with pytest.raises(ModelLoadError, match=r"could not be downloaded: it holds 2 .gguf files; name one as "
                                             r"org/name/<file>.gguf \(a.Q4.gguf, a.Q8.gguf\)"):
        resolve_hub_path("org/g")
    assert is_hub_id("org/g/a.Q8.gguf")
    path = resolve_hub_path("org/g/a.Q8.gguf")
    assert path.name == "a.Q8.gguf" and path.is_file() and calls == [["config.json", "a.Q8.gguf"]]
    with pytest.raises(ModelLoadError, match="has no file 'b.gguf'"):
        resolve_hub_path("org/g/b.gguf")


# --------------------------------------------------------------------------- local paths and the CLI


def test_a_local_path_wins_over_a_hub_id(tmp_path, tiny_llama, monkeypatch, hf_cache, connections):
    src, _ = tiny_llama()
    assert resolve_model_path(src)[0] == src
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(src)
    assert not is_hub_id("org/tiny")
    assert resolve_model_path("org/tiny")[0] == Path("org/tiny")
    assert connections == []


def test_serve_flags_resolve_hub_ids_before_the_engine_starts(hf_cache, tiny_llama, monkeypatch):
    from core.cli import build_parser
    from core.engine.config import engine_args_from_namespace

    src, _ = tiny_llama()
    v1 = cache_repo(hf_cache, "org/tiny", src, ref="v1", commit=OTHER_COMMIT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ns = build_parser().parse_args(["serve", "--model-path", "org/tiny", "--revision", "v1",
                                    "--tokenizer-path", "org/tiny"])
    args = engine_args_from_namespace(ns, getattr(ns, "_plugin_dests", ()))
    assert (args.model_path, args.tokenizer_path) == (str(v1), str(v1))
    assert (args.served_model_name, args.revision) == ("org/tiny", "v1")
    assert ns.model_path == "org/tiny"  # what /get_model_info reports
    missing = build_parser().parse_args(["serve", "--model-path", "org/missing"])
    with pytest.raises(ModelLoadError, match="'org/missing' does not exist locally"):
        engine_args_from_namespace(missing)


def test_generate_command_refuses_an_uncached_id_in_one_line(hf_cache, monkeypatch, capsys):
    from core.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "hi", "--model-path", "org/missing"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("core generate: error: model path 'org/missing' does not exist locally")
