"""Data: input sources (files, JSONL, Parquet, hf:, built-in corpora), tokenizers, token shards with
their manifest, `prepare` (text -> shards) and the training loader (which owns its cursor).

May import: ground files, gptrain.config.
"""
