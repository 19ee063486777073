"""Images in HTTP requests: SGLang's ``/generate`` ``image_data`` and OpenAI chat ``image_url``
content parts, decoded under the server's :class:`MediaPolicy` (``core.engine.multimodal.images``)
for ``engine.make_requests(..., images=...)``.

An image sent to a server without a vision-language model (``engine.multimodal`` is None) is a
400 saying the model is text-only. Decoding happens on a worker thread (see ``needs_thread``):
a URL fetch must never stall the event loop."""

from __future__ import annotations

from typing import Any

from core.engine.multimodal.images import MediaPolicy, images_per_prompt, load_images, load_prompt_images
from core.errors import InvalidRequest

# SGLang's GenerateReqInput.modalities values for images
IMAGE_MODALITIES = ("image", "multi-images")
IMAGE_DETAILS = ("auto", "low", "high", "default")  # OpenAI's; "default" is SGLang's alias of auto


def media_policy(state: Any) -> MediaPolicy:
    """The server's image policy: its flags, and the processor's own ``max_images``."""
    policy = MediaPolicy.from_args(state.engine.args)  # (the media flags are engine arguments)
    own = getattr(state.engine.multimodal, "max_images", None)
    if own is not None and (policy.max_images is None or own < policy.max_images):
        import attrs

        policy = attrs.evolve(policy, max_images=own)
    return policy


def require_multimodal(state: Any, what: str, param: str) -> None:
    """A 400 when the served model takes no images."""
    if getattr(state.engine, "multimodal", None) is None:
        raise InvalidRequest(f"{what}, but the model {state.served_model_name!r} is text-only: images need a "
                             "vision-language model served with --enable-multimodal", param=param)


def images_kwargs(images: list | None) -> dict[str, Any]:
    """``make_requests``' keyword for a prompt's images (none for a prompt without)."""
    return {"images": images} if images else {}


# ----------------------------------------------------------------------------- /generate
def generate_images(state: Any, image_data: Any, modalities: Any, n: int, batch: bool) -> list[list]:
    """Each prompt's decoded images from a /generate body's ``image_data`` (SGLang's forms, see
    ``images_per_prompt``); ``modalities`` may only name images."""
    mods = modalities if isinstance(modalities, list) else [] if modalities is None else [modalities]
    for m in mods:
        if m is not None and m not in IMAGE_MODALITIES:
            raise InvalidRequest(f"modality {m!r} is not supported by this server (only images: "
                                 f"{', '.join(IMAGE_MODALITIES)})", param="modalities")
    per_prompt = images_per_prompt(image_data, n, batch)
    if not any(per_prompt):
        return per_prompt
    require_multimodal(state, "image_data was sent", "image_data")
    return load_prompt_images(per_prompt, media_policy(state), batch)


# ----------------------------------------------------------------------------- OpenAI chat
def image_part_url(part: dict, where: str) -> str:
    """The image of an OpenAI ``{"type": "image_url", "image_url": {"url", "detail"}}`` part
    (``image_url`` may also be the URL string itself). ``detail`` is checked and otherwise not
    used: the model's processor sizes every image (SGLang does the same for Qwen2-VL)."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise InvalidRequest(f"{where}.image_url must be an object with a 'url' string", param=f"{where}.image_url")
    detail = spec.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise InvalidRequest(f"{where}.image_url.detail must be one of auto, low, high; got {detail!r}",
                             param=f"{where}.image_url.detail")
    return spec["url"]


def has_image_parts(messages: Any) -> bool:
    """Whether any message has an ``image_url`` content part (its decoding goes off the loop)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in messages)


def chat_images(state: Any, urls: list[str]) -> list:
    """A chat request's images, decoded in the order their parts appear."""
    if not urls:
        return []
    return load_images(urls, media_policy(state), "messages")


def needs_thread(image_data: Any) -> bool:
    """Whether a body's images are decoded on a worker thread (any image: URLs are fetched)."""
    return image_data not in (None, [], "")
