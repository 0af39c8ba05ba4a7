"""Training frameworks that create DistributedDataParallel themselves, and
pygraph_dist in its place: Lightning and Fabric (:mod:`.lightning`), Hugging
Face Accelerate and the Trainer (:mod:`.hf`).

Each integration is a module of its own that imports its framework, so that
``import pygraph_dist`` never does; a missing framework is an ``ImportError``
naming the extra to install (``pip install pygraph_dist[lightning]``, ``[hf]``).
"""
