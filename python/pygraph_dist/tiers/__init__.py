"""How an iteration becomes graphs: tier 1 captures the whole iteration
(``capture``); tier 2 captures forward, backward and the step as separate graphs
around the user's code (``split``, ``split_lane``, ``split_calls``,
``split_clip``); evaluation graphs (``evaluation``).

May import: runtime, launch, reports, loop, graphs, reduce, step. (Layers: tests/python/test_layers.py.)
"""
