"""memguard's benchmark harness (``memguard bench``): real training cases run here and the estimate
scored against them (docs/benchmarks.md). Above the adapters in the layers (it runs HF, mlx_lm and
plain torch children); the core reaches it through the ``memguard.features`` entry point ``bench``
(``cli.main``). The case tables are data: ``data/archs_*.toml`` and ``data/cases.toml``.
"""
