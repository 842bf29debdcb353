"""Checkpoints: atomic, verified checkpoint folders (full state on rank 0, or DCP shards per rank),
which checkpoint to resume from and which to keep.

May import: ground files, gptrain.config, gptrain.model, gptrain.data, gptrain.distributed.
"""
