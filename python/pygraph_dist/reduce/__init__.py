"""Gradients across ranks: flat buckets and their layout (``bucket_layout``),
each bucket's collective (``bucket_comm``), the reducer and its autograd hooks
(``reducer``), and gradients the graph owns (``grad_adoption``).

May import: runtime, launch, reports, loop, graphs. (Layers: tests/python/test_layers.py.)
"""
