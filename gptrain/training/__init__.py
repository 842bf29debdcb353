"""Training: building the model and optimizer for a run, the micro-batch and accumulation, one
optimizer step, guards (preemption, non-finite steps), the phases of a run, optimizers and
schedules, precision.

May import: everything below it (ground, config, model, data, logs, distributed, checkpoint, evals).
"""
