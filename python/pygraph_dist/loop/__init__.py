"""The user's training loop as the engine reads it, and ``wrap()``'s options
(``config``, ``compiled``): autocast (``amp``), the optimizer's param groups and
hyperparameters (``param_groups``), the loop monitor and its logging
(``monitor``), the rules a graphed loop must keep (``conformance``), the
arguments and outputs of a model call (``arguments``, ``fast_lane``,
``outputs``), gradient accumulation (``accumulation``) and the loss a loop
returns (``loss_lane``, ``loss_match``).

May import: runtime, launch, reports. (Layers: tests/python/test_layers.py.)
"""
