"""Integrations with training frameworks that create DistributedDataParallel themselves.

Each submodule imports its framework only when it is imported itself (``import
pygraph_dist`` never does), and names the extra to install when it is missing.
"""
