"""A request's image, checked before it is queued (`Engine.submit`).

An image is the pixel values transformers' image processor gives the
model (normalised floats): a torch tensor (or anything ``torch.as_tensor``
takes, a NumPy array) of shape ``[channels, size, size]`` or ``[1,
channels, size, size]`` at the tower's ``num_channels`` and ``image_size``
(896 x 896 for gemma-3-4b), dtype float32, float16 or bfloat16, every value
finite. The prompt holds the image's ``mm_tokens_per_image`` tokens
(``image_token_index``) as one run where the image goes; a prompt without
an image holds none. One image per request.

`check_image` returns the image as a ``[1, channels, size, size]`` CPU
tensor (moved to the device at prefill) and the KV manager's multimodal
key for it, ``(start, end, content_hash)``: a 128-bit BLAKE2b of the
pixel values (as float32) and their shape, so that the prefix cache never
shares a block computed with one image with a request for another behind
the same token ids (the manager chains the hash into every block the
image's tokens touch, and into every later block).

A bad image is refused with `InvalidArgument` naming ``image`` and what to
change; nothing is queued.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from imp_mem.engine.config import ModelConfig
from imp_mem.errors import InvalidArgument

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def content_hash(pixels: torch.Tensor) -> int:
    """The image's 128-bit key: BLAKE2b of its shape and float32 values."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(pixels.shape)).encode())
    h.update(pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def image_span(config: ModelConfig, prompt: Sequence[int]) -> tuple[int, int] | None:
    """``(start, end)`` of the prompt's run of image tokens; None when it
    has none. More than one run, or a run of another length than
    ``mm_tokens_per_image``, is `InvalidArgument`."""
    vision = config.vision
    if vision is None:
        return None
    token, n = vision["image_token_index"], vision["mm_tokens_per_image"]
    at = [i for i, t in enumerate(prompt) if t == token]
    if not at:
        return None
    start, end = at[0], at[-1] + 1
    if end - start != len(at) or len(at) != n:
        raise InvalidArgument(
            f"image: the prompt must hold one run of exactly {n} image tokens "
            f"(image_token_index {token}) where the image goes; it holds {len(at)} between "
            f"positions {start} and {end - 1}"
        )
    return start, end


def check_image(
    config: ModelConfig, prompt: Sequence[int], image: Any
) -> tuple[torch.Tensor | None, list[tuple[int, int, int]] | None]:
    """``(pixels, mm)`` of a request (module doc): ``(None, None)`` for a
    prompt without an image."""
    vision = config.vision
    if image is None:
        if vision is not None and image_span(config, prompt) is not None:
            raise InvalidArgument(
                f"image: the prompt holds image tokens (image_token_index "
                f"{vision['image_token_index']}) but no image was given; pass image= or drop them"
            )
        return None, None
    if vision is None:
        raise InvalidArgument(
            f"image: model_type {config.model_type!r} has no vision tower; pass image=None"
        )
    if not isinstance(image, torch.Tensor):
        try:
            image = torch.as_tensor(image)
        except (TypeError, ValueError, RuntimeError) as err:
            raise InvalidArgument(
                f"image: expected a tensor of pixel values, got {type(image).__name__}"
            ) from err
    shape = (vision["num_channels"], vision["image_size"], vision["image_size"])
    if tuple(image.shape) not in (shape, (1, *shape)):
        raise InvalidArgument(
            f"image: shape {tuple(image.shape)} is not the tower's; pass {list(shape)} or "
            f"{[1, *shape]} (channels, then image_size x image_size pixels)"
        )
    if image.dtype not in _DTYPES:
        raise InvalidArgument(
            f"image: dtype {image.dtype} is not a float dtype; pass float32, float16 or bfloat16 "
            "pixel values (the image processor's normalised output)"
        )
    if not bool(torch.isfinite(image).all()):
        raise InvalidArgument("image: the pixel values hold NaN or infinity")
    span = image_span(config, prompt)
    if span is None:
        raise InvalidArgument(
            f"image: the prompt holds no image tokens; put {vision['mm_tokens_per_image']} "
            f"tokens of image_token_index {vision['image_token_index']} where the image goes"
        )
    pixels = image.detach().reshape(1, *shape).to("cpu").contiguous()
    return pixels, [(span[0], span[1], content_hash(pixels))]
