"""bloomery: an ahead-of-time compiler and thin runtime for ModelOpt-quantized LLM checkpoints."""

__version__ = "0.1.0"
