"""Named refusals of the runtime (each a BloomeryError: the command line prints one line and exits non-zero)."""

from bloomery.core.errors import BloomeryError


class RuntimeRefusal(BloomeryError):
    """Base of the runtime's refusals."""


class NoPlan(RuntimeRefusal):
    """The artifact holds no execution plan (prepared before plans existed, or by another tool)."""


class PlanMismatch(RuntimeRefusal):
    """The plan and the artifact disagree (a weight missing or of another shape), or the ranks' plans differ."""


class TokenOutOfVocab(RuntimeRefusal):
    """A token id is outside [0, vocab_size)."""


class PromptTooLong(RuntimeRefusal):
    """The tokens do not fit the context (--ctx-size)."""


class DeviceUnavailable(RuntimeRefusal):
    """The requested device cannot run here (or its executor is not implemented yet)."""


class InsufficientDeviceMemory(RuntimeRefusal):
    """The model's weights and buffers do not fit the GPU's free memory (refused before the upload)."""


class NoVerifyProgram(RuntimeRefusal):
    """Speculative decoding asked of an artifact or executor without the verify step."""


class NoDraft(RuntimeRefusal):
    """A draft asked of an artifact that cannot give it (--draft mtp without MTP tensors), or with sampling."""
