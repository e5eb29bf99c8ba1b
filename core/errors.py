"""Named errors. Every refusal bloomery makes is one of these classes, and its message
names the file and tensor involved, what was found, what was expected and, where one
exists, the fix. The command line prints the message (no traceback) and exits non-zero."""


class BloomeryError(Exception):
    """Base of every refusal bloomery makes on purpose."""

    exit_code = 2


# --- stored formats (core/formats) -------------------------------------------------


class FormatError(BloomeryError):
    """A quantized tensor's stored parts do not make a valid value of its format."""


class NonFiniteScale(FormatError):
    """A scale holds NaN or Inf."""


class NegativeScale(FormatError):
    """A scale is negative (every format here scales by a magnitude)."""


class MissingScale(FormatError):
    """A part the format needs (a scale, a global scale) is absent."""


class UnexpectedScale(FormatError):
    """A part is present that the format does not have."""


class ScaleShapeMismatch(FormatError):
    """A scale (or a packed weight) has the wrong shape for its weight."""


class ScaleDtypeMismatch(FormatError):
    """A scale or a weight is stored in the wrong dtype for its format."""


class NotOnBlockBoundary(FormatError):
    """A cut (a tensor-parallel slice, a row length) does not fall on the format's block boundary."""


# --- checkpoint folders (compiler/checkpoint) --------------------------------------


class CheckpointError(BloomeryError):
    """A checkpoint folder is malformed."""


class UnreadableJSON(CheckpointError):
    """A JSON file of the folder does not parse or has the wrong structure."""


class NoWeights(CheckpointError):
    """The folder has no safetensors weights (pickle files are never read)."""


class UnknownQuantAlgo(CheckpointError):
    """The quantization config names an algorithm bloomery does not know."""


class MissingShard(CheckpointError):
    """The index names a shard file that is not in the folder."""


class IndexOutsideFolder(CheckpointError):
    """An index entry points outside the checkpoint folder."""


class TensorNotInShard(CheckpointError):
    """A tensor listed in the index is not in the shard the index names."""


class TruncatedShard(CheckpointError):
    """A shard is shorter than its header says."""


class HeaderTooLong(CheckpointError):
    """A shard's header length runs beyond the end of the file."""


class BadHeader(CheckpointError):
    """A shard's header is not valid safetensors JSON."""


class OverlappingTensors(CheckpointError):
    """Two tensors of a shard claim the same bytes."""


class TensorOutOfBounds(CheckpointError):
    """A tensor's byte range lies outside the shard's data, or does not match its shape and dtype."""


class UnsupportedDtype(CheckpointError):
    """A tensor has a dtype bloomery cannot read."""


class DuplicateTensor(CheckpointError):
    """Two shards hold a tensor of the same name."""
