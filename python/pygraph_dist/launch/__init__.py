"""Processes and their groups: where a rank is and how the job started
(``launch_env``: torchrun, Open MPI, MPICH, Slurm), the ``pygraph-launch`` command
(``cli``; also ``python -m pygraph_dist.launch``), the graph-safe c10d backend
(``backend``), collectives over any backend (``collectives``), every decision the
ranks must share (``agreement``), the end of a job (``lifetime``) and the native
replay watchdog (``watchdog``).

May import: runtime. (Layers: tests/python/test_layers.py.)
"""
