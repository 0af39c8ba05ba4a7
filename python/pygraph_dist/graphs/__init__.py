"""What any captured graph is made with: capturing safely and turning a failed
capture into a reason (``capture_guard``), the per-input-signature cache of
graphs with their selection and release (``graph_cache``), what a graph's memory
pool holds (``pool_account``), and host tensors that forward copies to the device
(``host_values``, ``host_record``, ``host_session``, ``host_copies``).

May import: runtime, launch, reports, loop. (Layers: tests/python/test_layers.py.)
"""
