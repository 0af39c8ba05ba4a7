"""pygraph_dist.launch.collectives does what torch.distributed does (issue 25).

pygraph_dist's own collectives are issued through ``pygraph_dist._C``
(csrc/python_free.h) so that their Works hold no Python object; they must
still run the same collective, with the same result, as the
``torch.distributed`` function they replace: over a stock Gloo group on CPU
here, over a stock NCCL group (eager and captured into a CUDA graph) on GPU.
What the Works hold is tested in test_faults_exit_stress.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def same_as_torch(backend: str = "gloo", capture: int = 0) -> dict:
    """Each collective through pygraph_dist.launch.collectives and through
    torch.distributed on the same inputs, over the script's own group."""
    from pygraph_dist.launch import collectives as coll

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = torch.Generator().manual_seed(rank)

    def inputs(dtype=torch.float32):
        return torch.randn(257, generator=g).to(dtype).to(dev)

    checks: dict[str, bool] = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        a = inputs()
        b = a.clone()
        coll.all_reduce(a, op=op)
        dist.all_reduce(b, op=op)
        checks[f"all_reduce_{name}"] = torch.equal(a, b)
    a = inputs(torch.complex64) if dev.type == "cpu" else inputs()  # complex: as its real view
    b = a.clone()
    work = coll.all_reduce(a, async_op=True)
    work.wait()
    dist.all_reduce(b)
    checks["all_reduce_async"] = torch.equal(a, b)
    a = inputs()
    b = a.clone()
    coll.broadcast(a, group_src=world - 1)
    dist.broadcast(b, src=world - 1)
    checks["broadcast"] = torch.equal(a, b)
    x = inputs()
    ours = [torch.empty_like(x) for _ in range(world)]
    theirs = [torch.empty_like(x) for _ in range(world)]
    coll.all_gather(ours, x)
    dist.all_gather(theirs, x)
    checks["all_gather"] = all(torch.equal(o, t) for o, t in zip(ours, theirs))
    obj = {"rank": rank, "payload": list(range(rank * 50))}  # sizes differ per rank
    theirs_obj = [None] * world
    dist.all_gather_object(theirs_obj, obj)
    checks["all_gather_object"] = coll.all_gather_object(obj, device=dev) == theirs_obj
    if capture:
        # A stock NCCL all-reduce captured into a CUDA graph through
        # pygraph_dist.launch.collectives (what tier 2 does with the user's own group).
        y = torch.full((1024,), float(rank + 1), device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            coll.all_reduce(y, async_op=True).wait()  # warm-up: the communicator exists
        torch.cuda.current_stream().wait_stream(s)
        y.fill_(float(rank + 1))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # as capture.py captures
            coll.all_reduce(y, async_op=True).wait()
        y.fill_(float(rank + 1))
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        total = world * (world + 1) / 2
        checks["captured_replays"] = bool((y == total * world).all())  # sum, then the sum of sums
        # The graph holds NCCL's reference to the communicator: destroying the group
        # while it lives blocked both ranks in destroy_process_group() at world size 2
        # (2xH100, NCCL 2.28.9; stacks from run_ranks' SIGUSR1 dump). The engine
        # releases its graphs first (lifetime.py); a hand-made graph must too.
        del graph
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return {"checks": checks}


@pytest.mark.parametrize("world", [1, 2])
def test_collectives_match_torch_over_stock_gloo(ranks, world):
    for r in ranks("test_collectives:same_as_torch", world_size=world, timeout=120):
        assert r["checks"] and all(r["checks"].values()), r["checks"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_collectives_match_torch_over_stock_nccl(ranks, world):
    for r in ranks("test_collectives:same_as_torch", world_size=world, timeout=150,
                   kwargs={"backend": "nccl", "capture": 1}):
        assert "captured_replays" in r["checks"] and all(r["checks"].values()), r["checks"]
