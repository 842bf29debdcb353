"""Subcommands: one module per `gptrain NAME`, each with `main(argv) -> int`. Imported only by
gptrain/__main__.py.

May import: anything in gptrain.
"""
