"""What ``pygraph_dist.report()`` says: the records (``reporting``: ``Report``,
``ModelReport``), their text (``report_text``), reasons cut into items with their
fixes (``report_reasons``) and what we know of a model class that graphs
differently (``model_notes``). Plain data and text: the engine fills the records.

May import: runtime, launch. (Layers: tests/python/test_layers.py.)
"""
