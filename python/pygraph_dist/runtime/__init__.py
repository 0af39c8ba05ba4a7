"""What everything else stands on: the native extension (``_ext``, which loads
``pygraph_dist._C`` and checks its torch version), every change we make to code we
do not own (``patches``: rebinding, class swaps, torch flags, private torch
attributes, each listed with how it is undone), host-time spans for benchmarks
(``spans``) and the fused kernels of the hot path (``kernels``).

May import: nothing of the package. (Layers: tests/python/test_layers.py.)
"""
