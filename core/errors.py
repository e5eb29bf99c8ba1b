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


# --- specs, levers and tensor planning (core/specs, core/levers, compiler/planning) --------


class SpecError(BloomeryError):
    """A spec file (specs/*.yaml) is malformed: a missing or unknown field, a bad expression."""


class UnknownArchitecture(BloomeryError):
    """No spec serves the checkpoint's architectures / model_type."""


class MissingConfigKey(CheckpointError):
    """config.json lacks a value the model's spec needs."""


class UnsupportedConfig(CheckpointError):
    """config.json asks for a feature bloomery does not implement (e.g. a rope scaling type)."""


class LeverError(BloomeryError):
    """A lever (environment switch) has a value it does not take, or conflicts with an option."""


class BadLeverValue(LeverError):
    """A lever is set to a value outside its registry row."""


class LeverConflict(LeverError):
    """A lever and a command-line option ask for opposite things (--keep-bf16 with BLOOMERY_PREPARE_Q8=1)."""


class PlanError(BloomeryError):
    """The checkpoint's tensors do not fit the model's spec, or cannot be placed in the artifact."""


class UnknownTensor(PlanError):
    """A checkpoint tensor matches no template of the spec."""


class MissingTensor(PlanError):
    """A tensor the spec expects is not in the checkpoint."""


class TensorShapeMismatch(PlanError):
    """A tensor's logical shape differs from the one the spec computes from config.json."""


class ConstantMismatch(PlanError):
    """A stored tensor whose values the config determines (qwen4_exp's n-gram hash buffers) holds others."""


class MixedExpertFormats(PlanError):
    """The experts stacked into one artifact tensor are stored in different formats."""


class FormatNotAllowed(PlanError):
    """A tensor's stored format is one the runtime cannot read in its role."""


class TPNotDivisible(PlanError):
    """A dimension (heads, KV heads, rows) does not divide by the tensor-parallel size."""


# --- the artifact (core/artifact, compiler/writer, compiler/publish) ----------------


class ArtifactError(BloomeryError):
    """An artifact folder is damaged, incomplete or not a bloomery artifact."""


class ArtifactMalformed(ArtifactError):
    """An artifact's GGUF tensors or metadata do not match what its layout says."""


class ArtifactMissingShard(ArtifactError):
    """A shard (or SHA256SUMS) the artifact names is not in its folder, or an unlisted file is."""


class ArtifactChecksumMismatch(ArtifactError):
    """A file of the artifact does not match its SHA-256 in SHA256SUMS, or a shard's header or tensor
    its digest in DIGESTS.json."""


class ShardSizeMismatch(ArtifactError):
    """A shard's size is not the one DIGESTS.json records (truncated, or bytes added)."""


class ArtifactLocked(ArtifactError):
    """Another prepare is publishing to the same output (when asked not to wait)."""


class BadKernelRecord(ArtifactError):
    """An artifact's ahead-of-time kernel record (metadata bloomery.kernels, core/artifact/kernels.py)
    is damaged or of another version, or a --target is not one bloomery compiles for."""


class KernelCompileUnavailable(BloomeryError):
    """prepare --target cannot compile its kernels here: the CUTLASS DSL is missing, or its compile failed."""


class PublishVerifyFailed(ArtifactError):
    """A shard just written does not read back as planned (sizes, checksums, decoded values)."""


class MetadataTypeError(ArtifactError):
    """A metadata value has no GGUF type (a dict, an empty or mixed list, None)."""


class OutputNotArtifact(ArtifactError):
    """The output path exists and is neither an empty folder nor a bloomery artifact: never replaced."""
