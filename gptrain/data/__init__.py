"""Data: input sources (files, JSONL, Parquet, compressed, hf:, built-in corpora, llm.c shards),
tokenizers, token shards with their document indexes and manifest, `prepare` (text -> resumable
parts -> shards; llm.c shards in and out) and the training loader (which owns its cursor).

May import: ground files, gptrain.config.
"""
