"""Configuration: one dataclass per section (each field documented once; that text is `--help`),
TOML + `--section.key=value` loading, and validation beside each section.

May import: the ground files (gptrain.errors, gptrain.cache).
"""
