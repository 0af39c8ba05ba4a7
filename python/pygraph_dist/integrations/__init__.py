"""Training frameworks that create their own DDP, and pygraph_dist in its place.

Each integration is a module of its own that imports its framework, so that
``import pygraph_dist`` never does; a missing framework is an ``ImportError``
naming the extra to install (``pip install pygraph_dist[lightning]``).
"""
