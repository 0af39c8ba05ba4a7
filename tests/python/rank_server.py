"""A fork server for the CPU tests' rank processes: torch imported once, a fresh process per rank.

Most of a CPU test's time went to starting its rank processes: each rank a new
Python that imports torch, torch.distributed, pygraph_dist and the test module
(several seconds on the 2-core CI machine, two or four ranks per test, some
400 launches per run). This server does those imports once; each rank is then
a ``fork()`` of it, so that:

* every rank is still a process of its own, started for this test and gone
  after it: what a test body leaves behind (patched torch functions, process
  groups, engines, environment variables, module globals) dies with it and
  cannot reach the next test, exactly as with ``python rank_main.py``;
* each rank gets its own environment (the launcher's variables, the test's
  ``env=``), working directory, ``sys.argv`` and log file, and runs
  ``rank_main.main`` as the script would, ending with the interpreter's usual
  exit (atexit handlers, exit status, a traceback on stderr);
* the test side (``conftest.run_ranks``) keeps its timeouts: it polls each rank
  through ``ForkedRank`` (the subset of ``subprocess.Popen`` it uses), and a
  rank past its time gets SIGUSR1 (stacks into its log) and SIGKILL as before.

What it does not cover, on purpose: ranks of GPU tests (CUDA and the GPU
timings keep plain processes), tests that assert how a process exits (they
start their own processes, not ``run_ranks``), and any test run with
``PGD_TEST_FRESH_RANKS=1`` (every rank a new Python again, to rule this server
out when a test misbehaves).

The server is started per environment, rank included: an environment variable
read at import (``PYGRAPH_DIST_HOST_SPANS``, or ``RANK`` in Lightning) is seen
at import as a new rank would see it, because ranks whose environment differs
(in anything but ``MASTER_PORT``) get servers of their own; so the two ranks of
a test also differ in hash seed and address layout, as separate Pythons do.
Each rank draws new seeds for torch's and numpy's generators. The server must
stay single-threaded (``fork()`` copies one thread): it checks that after
every import. Before each fork it moves what it imported out of the garbage
collector's sight (``gc.freeze()``): a forked rank's collections then walk
only what the rank made. Without it they walked torch's whole heap (and wrote
to its pages): the CPU suite's forked ranks took 390 CPU-s on the 2-core
machine, 100 with it.

Protocol (JSON lines over a socketpair): the test side sends ``{"op": "spawn",
"id", "module", "argv", "env", "cwd", "log"}`` and ``{"op": "signal", "pid",
"sig"}``; the server answers ``{"id", "pid"}`` (or ``{"id", "error"}``) and
reports each exit as ``{"exit": pid, "rc": returncode}`` (Popen's convention).
EOF on the socket (the test process closed it or died) kills the server's
ranks and ends it; the server and its ranks also get SIGKILL when the test
process dies (``rank_main.die_with_the_test``).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = Path(__file__).resolve()
RANK_MAIN = HERE / "rank_main.py"
# What every rank imports: torch._dynamo too (pgd.init imports it before the process
# group exists, and any optimizer would; over 2 s of each rank's start on the CI machine).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pygraph_dist", "common")


# ---------------------------------------------------------------- the server

def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _serve(sock: socket.socket) -> dict:
    """Answer requests until EOF; returns only in a forked rank, with its request."""
    children: set[int] = set()
    buf = b""
    while True:
        while children:  # reap every rank that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([sock], [], [], 0.02 if children else 0.5)
        if not ready:
            continue
        data = sock.recv(1 << 16)
        if not data:  # the test process is gone or done: so are its ranks
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in children:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            os._exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            if req["op"] == "signal":
                if req["pid"] in children:  # never a pid that was reaped (and may be reused)
                    try:
                        os.kill(req["pid"], req["sig"])
                    except ProcessLookupError:
                        pass
                continue
            # "spawn": the test module first, so that the next rank of this module starts at once.
            # An import that fails is left to the rank, whose log then shows the traceback.
            # A test module's RANK_PRELOAD names what its rank bodies import (transformers, lightning).
            try:
                module = importlib.import_module(req["module"])
                for name in getattr(module, "RANK_PRELOAD", ()):
                    importlib.import_module(name)
            except BaseException:  # noqa: BLE001 -- the rank raises it again, in its log
                pass
            if _threads() > 1:
                _send(sock, {"id": req["id"], "error": f"the server has {_threads()} threads after importing "
                             f"{req['module']}: fork() would copy only one"})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            # What the server imported is never garbage: out of the collector's
            # sight, a rank's collections (pgd.shutdown() runs one) need not
            # walk it, nor write to its pages (copy-on-write), as a fork server should.
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                sock.close()
                return req
            children.add(pid)
            _send(sock, {"id": req["id"], "pid": pid})


def _become_rank(req: dict) -> None:
    """In the forked process: the rank's environment, directory, argv and log, as Popen would set them."""
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [str(RANK_MAIN), *req["argv"]]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A new Python seeds torch's default generator and numpy's global one at random (the
    # random module reseeds itself after fork): so does each forked rank, not the server's.
    sys.modules["torch"].default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def server_main(fd: int) -> None:
    sys.path.insert(0, str(HERE))
    import rank_main

    rank_main.die_with_the_test()  # the server dies with the test process; each rank with the server
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    if _threads() > 1:
        _send(sock, {"ready": False, "error": f"{_threads()} threads after importing torch"})
        return
    _send(sock, {"ready": True})
    req = _serve(sock)
    _become_rank(req)
    rank_main.main(req["argv"])  # then the interpreter exits as the script's would


# ---------------------------------------------------------------- the test side

class ServerGone(Exception):
    pass


class ForkedRank:
    """A rank forked by the server: the part of ``subprocess.Popen`` that run_ranks uses."""

    def __init__(self, server: "RankServer", pid: int, log: str):
        self.server, self.pid, self.log, self.returncode = server, pid, log, None

    def poll(self):
        if self.returncode is None:
            self.server.pump(0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.server.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:  # cannot happen after SIGKILL unless the server hangs
                self.server.close()
                break
            self.server.pump(0.05)
        return self.returncode


class RankServer:
    """The test side of one server (one per environment)."""

    def __init__(self, env: dict, log: Path, timeout: float = 120):
        import subprocess

        ours, theirs = socket.socketpair()
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(SERVER), str(theirs.fileno())], env=env,
                                         pass_fds=[theirs.fileno()], stdout=f, stderr=subprocess.STDOUT,
                                         cwd=str(HERE.parents[1]))
        theirs.close()
        self.sock = ours
        self.buf = b""
        self.ranks: dict[int, ForkedRank] = {}
        self.replies: dict[int, dict] = {}
        self.next_id = 0
        self.dead = False
        self.ready = self._wait_for(lambda: self.replies.pop(-1, None), timeout)
        if not self.ready.get("ready"):
            self.close()
            raise ServerGone(self.ready.get("error", "not ready"))

    def _why(self) -> str:
        try:
            tail = self.log.read_text()[-3000:]
        except OSError:
            tail = ""
        return f"the rank server (pid {self.proc.pid}) exited with {self.proc.poll()}; its log:\n{tail}"

    def _wait_for(self, get, timeout):
        deadline = time.monotonic() + timeout
        while True:
            got = get()
            if got is not None:
                return got
            if self.dead:
                raise ServerGone(self._why())
            if time.monotonic() > deadline:
                self.close()
                raise ServerGone(f"no answer within {timeout} s; " + self._why())
            self.pump(0.05)

    def pump(self, timeout: float) -> None:
        """Read what the server sent (waiting up to ``timeout`` s for it)."""
        if self.dead:
            return
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._gone()
            return
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "exit" in msg:
                rank = self.ranks.pop(msg["exit"], None)
                if rank is not None:
                    rank.returncode = msg["rc"]
            else:
                self.replies[msg.get("id", -1)] = msg

    def _gone(self) -> None:
        """The server ended: its ranks got SIGKILL (PR_SET_PDEATHSIG); their logs say why."""
        self.dead = True
        why = self._why()
        for rank in self.ranks.values():
            rank.returncode = -signal.SIGKILL
            with open(rank.log, "a") as f:
                f.write(f"\n[run_ranks] this rank was forked by a rank server that ended: {why}\n")
        self.ranks.clear()

    def _send(self, msg: dict) -> None:
        try:
            self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            self._gone()

    def spawn(self, module: str, argv: list[str], env: dict, cwd: str, log: str,
              timeout: float = 120) -> ForkedRank:
        if self.dead:
            raise ServerGone(self._why())
        self.next_id += 1
        rid = self.next_id
        self._send({"op": "spawn", "id": rid, "module": module, "argv": argv, "env": env, "cwd": cwd,
                    "log": log})
        reply = self._wait_for(lambda: self.replies.pop(rid, None), timeout)
        if "error" in reply:
            raise ServerGone(reply["error"])
        rank = ForkedRank(self, reply["pid"], log)
        self.ranks[reply["pid"]] = rank
        return rank

    def signal(self, pid: int, sig: int) -> None:
        self._send({"op": "signal", "pid": pid, "sig": int(sig)})

    def close(self) -> None:
        """EOF to the server: it kills its ranks and exits."""
        if not self.dead:
            self.dead = True
            self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()
        # Kept if it says something and the server did not end cleanly: the failures it caused name it.
        if self.proc.returncode == 0 or not self.log.exists() or self.log.stat().st_size == 0:
            self.log.unlink(missing_ok=True)


if __name__ == "__main__":
    server_main(int(sys.argv[1]))
