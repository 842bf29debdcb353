"""The process runtime: DistInfo from torchrun's environment, process groups and collectives, the one
place a model is wrapped (activation checkpointing -> compile -> DDP | FSDP2) and the one answer to
"is this run sharded?", failures of peers, launching workers, host memory settings.

May import: ground files, gptrain.config, gptrain.model.
"""
