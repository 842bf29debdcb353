"""The model: GPT-2 (attention, chunked output-head losses, KV-cache generation) and its Hugging Face
GPT-2 weights in and out. Knows nothing about distributed training, checkpoints or configs.

May import: torch, and the ground file gptrain.errors (hf.py only).
"""
