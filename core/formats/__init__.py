"""Stored weight formats: one `Format` instance per name (see base.py for the contract).

GGML repacks live beside their format: nvfp4.to_ggml / from_ggml, mxfp4.to_ggml / from_ggml,
q8_0.to_ggml / from_ggml."""

from __future__ import annotations

from . import dense, fp8_block32, fp8_block128, fp8_channel, fp8_tensor, mxfp4, mxfp8, nvfp4, q8_0
from .base import Format, PartSpec

FORMATS: dict[str, Format] = {f.name: f for f in (
    nvfp4.FORMAT, nvfp4.FORMAT_G32, mxfp4.FORMAT, mxfp8.FORMAT, fp8_tensor.FORMAT, fp8_channel.FORMAT,
    fp8_block128.FORMAT, fp8_block32.FORMAT, dense.BF16, dense.F16, dense.F32, q8_0.FORMAT)}


def get(name: str) -> Format:
    """The format called `name` (KeyError naming the known ones otherwise)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown stored format {name!r}; known: {', '.join(FORMATS)}") from None


__all__ = ["FORMATS", "Format", "PartSpec", "get"]
