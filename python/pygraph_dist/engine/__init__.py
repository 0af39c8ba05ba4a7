"""The engine that composes the layers below for one wrapped model: its parts
built by ``wiring``, probing the loop (``probe``), choosing and running a tier
(``engine``), and describing what happened for ``report()`` (``report``).

May import: runtime, launch, reports, loop, graphs, reduce, step, tiers. (Layers: tests/python/test_layers.py.)
"""
