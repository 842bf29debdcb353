"""What a run reports: loggers behind one interface (console, JSONL, text, TensorBoard, W&B), the
measured peak FLOP/s and MFU, loss plots.

May import: ground files, gptrain.config.
"""
