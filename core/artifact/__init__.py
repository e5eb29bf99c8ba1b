"""The artifact schema, shared by the compiler (writes it) and the runtime (reads it):
layout.py (how each format lies in GGUF) and reader.py (Artifact.open)."""

from .layout import from_gguf, gguf_parts, to_gguf
from .reader import Artifact, ArtifactTensor

__all__ = ["Artifact", "ArtifactTensor", "from_gguf", "gguf_parts", "to_gguf"]
