"""Decoding a request's images from the forms SGLang and OpenAI accept, and hashing them.

One image is given as (:func:`load_image`): a data URI (``data:image/png;base64,...``), raw
base64, bytes, a decoded ``PIL.Image.Image`` (offline ``Engine`` only), an ``http(s)://`` URL
(fetched with the standard library under a timeout and a size limit) or a local path /
``file://`` URL. What a server may do is its :class:`MediaPolicy`: URLs are fetched unless the
server was started offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) and only from
``--allowed-media-domains`` when that is set; local files are read only under
``--allowed-local-media-path DIR``. Every failure is an :class:`InvalidRequest` naming the
problem (and the flag that changes it), never a server error.

A batch's ``image_data`` in SGLang's forms goes through :func:`images_per_prompt`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import attrs
from PIL import Image, UnidentifiedImageError

from core.errors import InvalidRequest

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # SGLang's --media-url-max-file-size-mb default (64)
DEFAULT_TIMEOUT_S = 3.0  # SGLang's REQUEST_TIMEOUT default for image downloads
DEFAULT_MAX_PIXELS = 1 << 25  # per image, before any resizing: an 8K frame (7680x4320) fits
MAX_REDIRECTS = 5
_BASE64 = re.compile(r"[A-Za-z0-9+/\-_\s]+={0,2}\s*")
_PATH_LIKE = re.compile(r"(/|~|\./|\.\./|[A-Za-z]:[\\/])")
_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ico", ".ppm", ".pgm")


def offline() -> bool:
    """Whether the process was started offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


@attrs.define(frozen=True)
class MediaPolicy:
    """What a server (or the offline engine) may do to get a request's images.

    ``allow_url``: fetch ``http(s)`` URLs (``allowed_domains``, when not empty: only from these
    exact hosts, redirects included). ``allow_local``: read local paths and ``file://`` URLs
    (``local_root``: only files under that folder). ``max_bytes``: one image's encoded size
    (0: no limit); ``max_pixels``: one image's width x height; ``max_images``: images in one
    prompt (None: no limit); ``timeout``: seconds for one URL download, in all."""

    allow_url: bool = False
    allow_local: bool = False
    local_root: str | None = None
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_args(cls, args: Any) -> MediaPolicy:
        """The policy of a server started with ``args`` (SGLang's flag names; missing ones take
        SGLang's defaults): ``allowed_media_domains``, ``media_url_max_file_size_mb``,
        ``limit_mm_data_per_request`` (``{"image": N}``), ``allowed_local_media_path``. URLs are
        not fetched when the process runs offline."""
        root = getattr(args, "allowed_local_media_path", None) or None
        limits = getattr(args, "limit_mm_data_per_request", None) or {}
        if isinstance(limits, str):
            import json

            limits = json.loads(limits)
        size_mb = getattr(args, "media_url_max_file_size_mb", None)
        return cls(allow_url=not offline(), allow_local=root is not None,
                   local_root=None if root is None else os.path.realpath(os.path.expanduser(root)),
                   allowed_domains=tuple(_host(d) for d in getattr(args, "allowed_media_domains", None) or ()),
                   max_bytes=DEFAULT_MAX_BYTES if size_mb is None else int(size_mb) * 1024 * 1024,
                   max_images=limits.get("image") if isinstance(limits, dict) else None,
                   timeout=float(os.environ.get("REQUEST_TIMEOUT", DEFAULT_TIMEOUT_S)))


def load_image(item: Any, *, allow_local: bool, allow_url: bool, timeout: float = DEFAULT_TIMEOUT_S,
               max_bytes: int = DEFAULT_MAX_BYTES, max_pixels: int = DEFAULT_MAX_PIXELS,
               local_root: str | None = None, allowed_domains: tuple[str, ...] = (),
               param: str = "image_data") -> Image.Image:
    """One image, decoded and converted to RGB. ``item``: a data URI, raw base64, bytes, a
    ``PIL.Image.Image``, an ``http(s)`` URL (only with ``allow_url``) or a local path /
    ``file://`` URL (only with ``allow_local``; under ``local_root`` when given). Raises
    :class:`InvalidRequest` (``param``) naming the problem."""
    if isinstance(item, Image.Image):
        return _checked(item, max_pixels, param)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _decode(bytes(item), max_bytes, max_pixels, param)
    if not isinstance(item, str):
        raise InvalidRequest(f"an image must be a string (a data URI, base64, a URL or a path), got "
                             f"{type(item).__name__}", param=param)
    s = item.strip()
    if not s:
        raise InvalidRequest("an image is an empty string", param=param)
    low = s[:16].lower()
    if low.startswith("data:"):
        head, sep, payload = s.partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise InvalidRequest("an image data URI must be base64-encoded (data:image/...;base64,...)", param=param)
        return _decode(_b64(payload, param), max_bytes, max_pixels, param)
    if low.startswith(("http://", "https://")):
        if not allow_url:
            why = ("the server was started offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set)" if offline()
                   else "URL fetching is disabled")
            raise InvalidRequest(f"image URLs are not fetched: {why}; send the image as a data URI or base64",
                                 param=param)
        return _decode(fetch_url(s, timeout=timeout, max_bytes=max_bytes, allowed_domains=allowed_domains,
                                 param=param), max_bytes, max_pixels, param)
    if low.startswith("file://"):
        return _decode(read_local(urllib.parse.unquote(urllib.parse.urlparse(s).path), allow_local, local_root,
                                  max_bytes, param), max_bytes, max_pixels, param)
    if "://" in s[:16]:
        raise InvalidRequest(f"unsupported image URL scheme {s.split('://', 1)[0]!r}: use http(s), file or data",
                             param=param)
    path_like = _PATH_LIKE.match(s) is not None or s.lower().endswith(_EXTENSIONS)
    if _BASE64.fullmatch(s) and not s.lower().endswith(_EXTENSIONS):
        try:
            raw = _b64(s, param)
        except InvalidRequest:
            if not path_like:
                raise
        else:  # base64 may start with "/" (JPEG's "/9j/"): a path only when it decodes to no image
            if not path_like or _identifies(raw):
                return _decode(raw, max_bytes, max_pixels, param)
    if path_like and len(s) < 4096:
        return _decode(read_local(s, allow_local, local_root, max_bytes, param), max_bytes, max_pixels, param)
    raise InvalidRequest("an image must be a data URI, base64, an http(s) URL or a local file path; this one is none "
                         "of them", param=param)


def image_hash(img: Image.Image) -> int:
    """A 64-bit hash of an image's content: its size, mode and pixel bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{img.width}x{img.height}:{img.mode}:".encode())
    h.update(img.tobytes())
    return int.from_bytes(h.digest(), "big")


def load_prompt_images(per_prompt: list[list], policy: MediaPolicy, batch: bool) -> list[list[Image.Image]]:
    """Each prompt's images (``images_per_prompt``'s lists) decoded under ``policy``; errors name
    ``image_data[i]`` in a batch."""
    return [load_images(items, policy, f"image_data[{i}]" if batch else "image_data") if items else []
            for i, items in enumerate(per_prompt)]


def load_images(items: list, policy: MediaPolicy, param: str = "image_data") -> list[Image.Image]:
    """One prompt's images under ``policy`` (its ``max_images`` included)."""
    if policy.max_images is not None and len(items) > policy.max_images:
        raise InvalidRequest(f"the prompt has {len(items)} images, more than the limit of {policy.max_images} per "
                             "request (--limit-mm-data-per-request)", param=param)
    return [load_image(x, allow_local=policy.allow_local, allow_url=policy.allow_url, timeout=policy.timeout,
                       max_bytes=policy.max_bytes, max_pixels=policy.max_pixels, local_root=policy.local_root,
                       allowed_domains=policy.allowed_domains, param=f"{param}[{i}]" if len(items) > 1 else param)
            for i, x in enumerate(items)]


def images_per_prompt(image_data: Any, n: int, batch: bool) -> list[list]:
    """SGLang's ``image_data`` forms, one list of (undecoded) images per prompt: one image (a
    string, bytes or PIL image) for one prompt; a list for one prompt (its images); for a batch of
    ``n`` prompts a list aligned with it, each entry an image, a list of images, or None / [] for
    none. A bare image with a batch is given to every prompt, as SGLang does. None / []: none."""
    if image_data is None or (isinstance(image_data, list) and not image_data):
        return [[] for _ in range(n)]
    if not isinstance(image_data, list):
        return [[image_data] for _ in range(n)]
    if not batch:
        return [[x for x in image_data if x is not None]]
    if len(image_data) != n:
        raise InvalidRequest(f"image_data has {len(image_data)} entries but there are {n} prompts", param="image_data")
    return [[] if x is None else [y for y in x if y is not None] if isinstance(x, list) else [x] for x in image_data]


# ----------------------------------------------------------------------------- the sources
def fetch_url(url: str, *, timeout: float, max_bytes: int, allowed_domains: tuple[str, ...] = (),
              param: str = "image_data") -> bytes:
    """The body of an ``http(s)`` URL: at most ``max_bytes`` (0: no limit), within ``timeout``
    seconds in all, following up to 5 redirects (each destination checked against
    ``allowed_domains`` when that is set)."""
    deadline = time.monotonic() + timeout
    _check_host(url, allowed_domains, param)
    opener = urllib.request.build_opener(_Redirects(allowed_domains, param))
    request = urllib.request.Request(url, headers={"User-Agent": "core-engine", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout) as resp:
            declared = resp.headers.get("Content-Length")
            if max_bytes and declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(int(declared), max_bytes, param)
            out = bytearray()
            while chunk := resp.read(64 * 1024):
                out += chunk
                if max_bytes and len(out) > max_bytes:
                    raise _too_large(len(out), max_bytes, param, at_least=True)
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(out)
    except InvalidRequest:
        raise
    except urllib.error.HTTPError as e:
        raise InvalidRequest(f"fetching the image URL {_short(url)} failed: HTTP {e.code} {e.reason}",
                             param=param) from None
    except (TimeoutError, OSError) as e:  # socket.timeout, URLError (DNS, refused), resets
        if isinstance(e, TimeoutError) or "timed out" in str(e):
            raise InvalidRequest(f"fetching the image URL {_short(url)} timed out after {timeout:g} s",
                                 param=param) from None
        reason = getattr(e, "reason", e)
        raise InvalidRequest(f"fetching the image URL {_short(url)} failed: {reason}", param=param) from None
    except ValueError as e:  # a malformed URL
        raise InvalidRequest(f"invalid image URL {_short(url)}: {e}", param=param) from None


def read_local(path: str, allow_local: bool, local_root: str | None, max_bytes: int,
               param: str = "image_data") -> bytes:
    """A local image file's bytes, when local paths are allowed (and the file is under ``local_root``)."""
    if not allow_local:
        raise InvalidRequest("local image paths are disabled: start the server with --allowed-local-media-path DIR "
                             "to read images under DIR, or send the image as a data URI or base64", param=param)
    real = os.path.realpath(os.path.expanduser(path))
    if local_root is not None:
        root = os.path.realpath(local_root)
        if os.path.commonpath([real, root]) != root:
            raise InvalidRequest(f"the image path {path!r} is outside --allowed-local-media-path {local_root}",
                                 param=param)
    try:
        with open(real, "rb") as f:
            data = f.read(max_bytes + 1 if max_bytes else -1)
    except FileNotFoundError:
        raise InvalidRequest(f"image file not found: {path!r}", param=param) from None
    except OSError as e:
        raise InvalidRequest(f"cannot read the image file {path!r}: {e.strerror or e}", param=param) from None
    if max_bytes and len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param, at_least=True)
    return data


# ----------------------------------------------------------------------------- helpers
class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, at most ``MAX_REDIRECTS``, each destination checked like the URL."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, allowed_domains: tuple[str, ...], param: str) -> None:
        self.allowed_domains, self.param = allowed_domains, param

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN201 (urllib's signature)
        _check_host(newurl, self.allowed_domains, self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _host(domain: str) -> str:
    domain = domain.strip().rstrip(".").lower()
    if domain.startswith("[") and domain.endswith("]"):
        domain = domain[1:-1]
    try:
        return str(ipaddress.ip_address(domain))
    except ValueError:
        return domain.encode("idna").decode("ascii")


def _check_host(url: str, allowed: tuple[str, ...], param: str) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidRequest(f"invalid image URL {_short(url)}: only http(s) URLs are fetched", param=param)
    if allowed and _host(parsed.hostname) not in allowed:
        raise InvalidRequest(f"the image URL's host {parsed.hostname!r} is not in --allowed-media-domains "
                             f"({', '.join(allowed)})", param=param)


def _short(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:200] + "...")


def _b64(payload: str, param: str) -> bytes:
    s = re.sub(r"\s+", "", payload)
    try:
        if "-" in s or "_" in s:
            return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the image is not valid base64", param=param) from None


def _too_large(size: int, limit: int, param: str, at_least: bool = False) -> InvalidRequest:
    what = f"more than {limit}" if at_least else str(size)
    return InvalidRequest(f"the image is too large: {what} bytes, the limit is {limit} bytes "
                          "(--media-url-max-file-size-mb)", param=param)


def _decode(data: bytes, max_bytes: int, max_pixels: int, param: str) -> Image.Image:
    if max_bytes and len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param)
    if not data:
        raise InvalidRequest("the image is empty (0 bytes)", param=param)
    try:
        img = Image.open(io.BytesIO(data))  # lazy: reads the header, so the size is known before decoding
        _check_pixels(img.width, img.height, max_pixels, param)
        img.load()
    except InvalidRequest:
        raise
    except Image.DecompressionBombError:
        raise InvalidRequest(f"the image has too many pixels: more than the limit of {max_pixels} pixels per image",
                             param=param) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        why = "not an image format PIL can read" if isinstance(e, UnidentifiedImageError) else str(e)
        raise InvalidRequest(f"the image could not be decoded: {why}", param=param) from None
    return img.convert("RGB") if img.mode != "RGB" else img


def _identifies(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        return True
    except Exception:  # noqa: BLE001 (any failure: not an image)
        return False
    return True


def _check_pixels(w: int, h: int, max_pixels: int, param: str) -> None:
    if w < 1 or h < 1:
        raise InvalidRequest(f"the image is empty ({w}x{h} pixels)", param=param)
    if max_pixels and w * h > max_pixels:
        raise InvalidRequest(f"the image has too many pixels: {w}x{h} = {w * h}, more than the limit of {max_pixels} "
                             "pixels per image", param=param)


def _checked(img: Image.Image, max_pixels: int, param: str) -> Image.Image:
    _check_pixels(img.width, img.height, max_pixels, param)
    return img.convert("RGB") if img.mode != "RGB" else img
