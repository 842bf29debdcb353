"""The models: GPT-2 (gpt.py) and NanoChat (nanochat.py), picked by name through arch.py, with
shared attention (attention.py), chunked output-head losses (losses.py) and KV-cache generation
(decode.py), and their Hugging Face weights in and out (hf.py, hf_nanochat.py). Knows nothing
about distributed training, checkpoints or configs.

May import: torch, and the ground file gptrain.errors (hf.py, hf_nanochat.py only).
"""
