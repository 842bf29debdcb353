"""Evaluation: validation loss and bits per byte, HellaSwag, text generation from a checkpoint.

May import: ground files, gptrain.config, gptrain.model, gptrain.data, gptrain.logs,
gptrain.distributed, gptrain.checkpoint.
"""
