"""gptrain: train GPT-2-style language models from a laptop CPU to many GPUs on many machines."""

__version__ = "0.1.0"
