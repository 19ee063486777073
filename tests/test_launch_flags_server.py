"""SGLang's serving flags: HTTPS (``--ssl-*``), ``--fastapi-root-path``, ``--admin-api-key`` and
``--weight-version``. One real ``core serve`` over a tiny model serves HTTPS with all of them on
(a self-signed certificate made here, its key encrypted); the key matrix, the weight-version
endpoint and the start-up errors run in-process."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from core.errors import CoreError
from tests.server_utils import ServerProcess, launch, stop

KEY, ADMIN = "sk-user-key-1", "sk-admin-key-2"
PASSWORD = "pem-pass"
ROOT = "/api"
ROOT_DIR = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- certificates
def _self_signed(folder: Path, name: str, password: str | None) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (encrypted with ``password``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    enc = (serialization.BestAvailableEncryption(password.encode()) if password
           else serialization.NoEncryption())
    cert_path, key_path = folder / f"{name}-cert.pem", folder / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
    return cert_path, key_path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder, "server", PASSWORD)
    other, plain_key = _self_signed(folder, "other", None)
    return {"cert": cert, "key": key, "other": other, "plain_key": plain_key}


def _trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


# ---------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def srv(tiny_llama, certs: dict[str, Path]) -> Iterator[ServerProcess]:
    path, _ = tiny_llama()
    server = launch("--model-path", str(path), "--dtype", "float32", "--skip-server-warmup",
                    "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["key"]),
                    "--ssl-keyfile-password", PASSWORD, "--ssl-ca-certs", str(certs["cert"]),
                    "--fastapi-root-path", ROOT, "--api-key", KEY, "--admin-api-key", ADMIN,
                    "--weight-version", "v1", "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                    verify=_trusting(certs["cert"]))
    yield server
    stop(server)


@pytest.fixture(scope="module")
def client(srv: ServerProcess, certs: dict[str, Path]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.base_url, verify=_trusting(certs["cert"]), timeout=60) as c:
        yield c


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_https_with_an_encrypted_key_verifies_against_the_certificate(srv: ServerProcess, client: httpx.Client,
                                                                       certs: dict[str, Path]) -> None:
    """``--ssl-certfile``/``--ssl-keyfile``/``--ssl-keyfile-password``: the server speaks TLS with
    the certificate (a client trusting only it verifies the handshake, one trusting another CA
    fails it, plain HTTP gets no answer); ``--ssl-ca-certs`` asks no client certificate."""
    r = client.get("/get_model_info", headers=_bearer(KEY))
    assert r.status_code == 200 and r.url.scheme == "https", r.text
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(srv.base_url + "/health", verify=_trusting(certs["other"]), timeout=10)
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.base_url.replace("https://", "http://") + "/health", timeout=10)
    info = client.get("/get_server_info", headers=_bearer(KEY)).json()
    assert info["ssl_keyfile_password"] == "<redacted>" and info["admin_api_key"] == "<redacted>"
    assert info["ssl_certfile"] == str(certs["cert"])


def test_without_enable_http2_tls_answers_http11(srv: ServerProcess, certs: dict[str, Path]) -> None:
    """No ``--enable-http2``: ALPN offers only http/1.1, so a client offering h2 gets HTTP/1.1, as
    from SGLang's uvicorn (tests/test_launch_flags_http2.py has the flag on)."""
    with httpx.Client(base_url=srv.base_url, http2=True, verify=_trusting(certs["cert"]), timeout=30) as c:
        assert c.get("/health").http_version == "HTTP/1.1"


def test_root_path_is_the_asgi_root_path_as_sglang_sets_it(client: httpx.Client) -> None:
    """``--fastapi-root-path /api``: the proxy strips the prefix, so routes answer at their own
    paths; the request's URL carries the prefix (uvicorn's root_path, which SGLang passes it to),
    so a path that still holds the prefix is not found. Probes stay open under the prefix."""
    assert client.get("/get_model_info", headers=_bearer(KEY)).status_code == 200
    missing = client.get("/nope", headers=_bearer(KEY))
    assert missing.status_code == 404 and f"GET {ROOT}/nope" in missing.json()["error"]["message"]
    assert client.get(f"{ROOT}/get_model_info", headers=_bearer(KEY)).status_code == 404
    assert client.get("/health").status_code == 200


def test_admin_key_alone_opens_admin_endpoints_and_api_key_the_rest(client: httpx.Client) -> None:
    """With both keys (SGLang's rule): normal endpoints take only ``--api-key``, admin ones
    (``/flush_cache``, ``/update_weight_version``...) only ``--admin-api-key``; else a 401."""
    assert [client.get("/get_model_info", headers=_bearer(k)).status_code for k in (KEY, ADMIN, None)] == [200, 401, 401]
    assert [client.post("/flush_cache", headers=_bearer(k)).status_code for k in (ADMIN, KEY, None)] == [200, 401, 401]
    refused = client.post("/flush_cache", headers=_bearer(KEY)).json()
    assert "--admin-api-key" in refused["error"]["message"]


def test_weight_version_is_reported_and_relabelled(client: httpx.Client) -> None:
    """``--weight-version v1``: /get_model_info, /generate's meta_info and the non-streaming OpenAI
    responses' ``metadata`` report it; /update_weight_version (an admin endpoint) changes it."""
    user, admin = _bearer(KEY), _bearer(ADMIN)
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert client.get("/get_model_info", headers=user).json()["weight_version"] == "v1"
    assert client.post("/generate", json=gen, headers=user).json()["meta_info"]["weight_version"] == "v1"
    comp = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, headers=user).json()
    assert comp.get("metadata") == {"weight_version": "v1"}, comp
    assert client.post("/update_weight_version", json={"new_version": "v2"}, headers=user).status_code == 401
    r = client.post("/update_weight_version", json={"new_version": "v2"}, headers=admin)
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Weight version updated to v2",
                                                 "new_version": "v2"}
    assert client.get("/get_model_info", headers=user).json()["weight_version"] == "v2"
    chat = client.post("/v1/chat/completions", headers=user, json={"model": "m", "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert chat.json().get("metadata") == {"weight_version": "v2"}, chat.text
    assert client.post("/generate", json=gen, headers=user).json()["meta_info"]["weight_version"] == "v2"


# ---------------------------------------------------------------------------- in-process
def test_admin_and_api_key_matrix() -> None:
    """SGLang's decision for each key set, on an admin endpoint (/update_weights_from_disk) and a
    normal one (/v1/models): 401 when refused; past the check the stateless app answers 503."""
    from core.server.app import build_app

    async def status(app, path: str, key: str | None) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.post(path, json={}, headers=_bearer(key)) if path.startswith("/update")
                    else await c.get(path, headers=_bearer(key))).status_code

    async def matrix(api_key: str | None, admin_api_key: str | None) -> dict[str, list[int]]:
        app = build_app(None, api_key, admin_api_key)
        keys = (None, KEY, ADMIN)
        return {p: [await status(app, p, k) for k in keys] for p in ("/update_weights_from_disk", "/v1/models")}

    # columns: no key, --api-key, --admin-api-key
    assert asyncio.run(matrix(KEY, None)) == {"/update_weights_from_disk": [401, 503, 401], "/v1/models": [401, 503, 401]}
    assert asyncio.run(matrix(None, ADMIN)) == {"/update_weights_from_disk": [401, 401, 503], "/v1/models": [503, 503, 503]}
    assert asyncio.run(matrix(KEY, ADMIN)) == {"/update_weights_from_disk": [401, 401, 503], "/v1/models": [401, 503, 401]}


def test_update_weight_version_aborts_running_requests_unless_told_not_to(tiny_llama) -> None:
    """SGLang's /update_weight_version: ``new_version`` becomes the reported version;
    ``abort_all_requests`` (default true) aborts the running requests first, false leaves them."""
    from core.engine import AsyncEngine
    from core.engine.config import engine_args_from_kwargs
    from core.server.app import create_app
    from core.server.args import ServerArgs
    from core.server.state import build_state

    path, _ = tiny_llama(max_position_embeddings=2048)  # room for a request long enough to be running

    async def go() -> dict:
        args = engine_args_from_kwargs(dict(model_path=str(path), dtype="float32", max_total_tokens=4096,
                                            cpu_threads=1, device="cpu", grammar_backend="none"))
        engine = AsyncEngine(args)
        state = build_state(engine, ServerArgs(weight_version="start"))
        state.ready = True
        out: dict = {"start": state.weight_version}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://t",
                                     timeout=120) as c:
            for abort in (None, False):
                body = {"text": "hi", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
                gen = asyncio.create_task(c.post("/generate", json=body))
                while not engine.has_work() and not gen.done():
                    await asyncio.sleep(0.001)
                update = {"new_version": f"abort-{abort}"} | ({} if abort is None else {"abort_all_requests": abort})
                assert (await c.post("/update_weight_version", json=update)).status_code == 200
                meta = (await gen).json()["meta_info"]
                out[abort] = (meta["finish_reason"]["type"], meta["weight_version"])
        await engine.shutdown()
        return out

    out = asyncio.run(go())
    assert out == {"start": "start", None: ("abort", "abort-None"), False: ("length", "abort-False")}, out


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", "{key}"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "{cert}"], "--ssl-certfile needs --ssl-keyfile"),
    (["--ssl-ca-certs", "{cert}"], "--ssl-ca-certs has no effect without --ssl-certfile"),
    (["--ssl-keyfile-password", "x"], "--ssl-keyfile-password has no effect without"),
    (["--ssl-certfile", "{missing}", "--ssl-keyfile", "{key}"], "--ssl-certfile .*missing.pem: no such file"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}"], "encrypted: pass its password with --ssl-keyfile-password"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-keyfile-password", "wrong"],
     "--ssl-keyfile-password does not decrypt it"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{plain_key}"], "the key is the certificate's"),
    (["--ssl-certfile", "{other}", "--ssl-keyfile", "{plain_key}", "--ssl-ca-certs", "{plain_key}"],
     "cannot load --ssl-ca-certs"),
    (["--admin-api-key", ""], "--admin-api-key must not be empty"),
])
def test_bad_serving_flags_are_start_up_errors(certs: dict[str, Path], flags: list[str], message: str) -> None:
    from core.cli import build_parser
    from core.server.args import validate_serve_args

    paths = {k: str(v) for k, v in certs.items()} | {"missing": str(certs["cert"].parent / "missing.pem")}
    ns = build_parser().parse_args(["serve", "--model-path", "m", "--device", "cpu",
                                    *(f.format(**paths) for f in flags)])
    with pytest.raises(CoreError, match=message):
        validate_serve_args(ns)


def test_a_bad_certificate_stops_core_serve_with_one_line(certs: dict[str, Path]) -> None:
    """The CLI reports the flag and exits non-zero before loading a model, with no traceback."""
    r = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--model-path", "m", "--device", "cpu",
                        "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["key"])],
                       capture_output=True, text=True, cwd=ROOT_DIR, timeout=120)
    assert r.returncode != 0 and "--ssl-keyfile-password" in r.stderr and "Traceback" not in r.stderr, r.stderr
