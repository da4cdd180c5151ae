"""``towers bench`` and ``towers study``: one module per section (docs/performance.md)."""
