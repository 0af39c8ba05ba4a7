"""One training iteration's parts around the model: the optimizer made
graph-aware (``optim``), gradient clipping routed to the reducer
(``clip_route``), and the iteration itself, forward, backward, reduction and the
optimizer step, as tier 1 captures it (``step``).

May import: runtime, launch, reports, loop, graphs, reduce. (Layers: tests/python/test_layers.py.)
"""
