"""A host_cost worker: modes set up once, then measured in blocks on request.

``host_cost_ab.py --interleave N`` runs one worker per side (the base
revision's package, this tree's), each a process that sets up every (mode,
layers) once and then measures a block of ``steps`` steps when asked. The two
sides then alternate block by block, seconds apart, instead of one
40-second process after the other: a host whose speed drifts between minutes
(the shared H100 host of session 37 ran whole passes 2-3x slower than their
neighbours) drifts under both sides alike, and many short blocks cost less
device time than a few long passes, because each side sets its modes up once.

Protocol: one JSON request per line on stdin, one reply per request on
stdout as a line starting with ``REPLY `` (anything else a library prints
there is skipped by the reader):

    {"cmd": "hello"}                                  -> {"ok": true, "package": ..., "environment": {...}}
    {"cmd": "setup", "mode": "pgd_tier1", "layers": 8, "warmup": 20}
                                                      -> {"ok": true, "params": 18}
    {"cmd": "measure", "mode": "pgd_tier1", "layers": 8, "steps": 200}
                                                      -> {"ok": true, "p50_us": ..., "mean_us": ...}
    {"cmd": "quit"}

A request that fails replies ``{"ok": false, "error": "..."}``. Host time is
measured as in host_cost.py's host pass: perf_counter around one step, the
GPU synchronised (untimed) between steps (``host_cost.host_times``).

The hand-written ``hand_tier2`` recipe must be set up after every other mode
of its process: a graph captured after it makes its step graph's replay fail
with an illegal memory access (seen in session 37 with pygraph_dist never
imported; the host_cost passes are unaffected, they tear each mode down).
``host_cost_ab.py`` orders the setups so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_cost as hc  # noqa: E402 - the modes and the measurement of host_cost.py

REPLY = "REPLY "


def serve(args) -> int:
    import torch

    import pygraph_dist as pgd

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pgd.init()
    torch.manual_seed(1)
    batches = [(torch.randn(hc.BATCH, hc.WIDTH, device=dev), torch.randint(0, hc.CLASSES, (hc.BATCH,), device=dev))
               for _ in range(hc.BATCHES)]
    modes: dict[tuple[str, int], hc.Mode] = {}
    done: dict[tuple[str, int], int] = {}  # steps taken per mode, so blocks walk the batches on
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints of the libraries stay off the reply channel
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.get("cmd")
        if cmd == "quit":
            break
        try:
            if cmd == "hello":
                env = hc.environment(argparse.Namespace(steps=args.steps, warmup=args.warmup))
                reply = {"package": pgd.__file__, "environment": env}
            elif cmd == "setup":
                key = (req["mode"], int(req["layers"]))
                if key[0] in hc.GPU_ONLY and dev.type != "cuda":
                    raise RuntimeError(f"{key[0]} needs a CUDA GPU")
                if any(m == "hand_tier2" for m, _ in modes):
                    raise RuntimeError("hand_tier2 was set up already: it must come after every other mode "
                                       "(see the module docstring)")
                warmup = int(req.get("warmup", 20))
                mode = hc.Mode(key[0], key[1], dev, batches)
                mode.setup()
                hc.host_times(mode, warmup)
                mode.describe()
                modes[key], done[key] = mode, warmup
                reply = {"params": mode.n_params, "tier": mode.info.get("tier", ""),
                         "phase": mode.info.get("phase", "")}
            elif cmd == "measure":
                key = (req["mode"], int(req["layers"]))
                steps = int(req["steps"])
                ts = hc.host_times(modes[key], steps, done[key])
                done[key] += steps
                reply = {"p50_us": statistics.median(ts) * 1e6, "mean_us": statistics.fmean(ts) * 1e6}
            else:
                raise ValueError(f"unknown request {req!r}")
            reply["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the driver says which request failed, and why
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(REPLY + json.dumps(reply) + "\n")
        out.flush()
    for mode in modes.values():
        mode.teardown()
    pgd.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="host_cost worker for host_cost_ab.py --interleave "
                                "(see the module docstring)")
    p.add_argument("--steps", type=int, default=200, help="recorded in the environment only")
    p.add_argument("--warmup", type=int, default=20, help="recorded in the environment only")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
