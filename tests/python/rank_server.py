"""A fork server for the CPU tests' rank processes and scripts: torch imported once, a fresh process per rank.

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

Scripts too (``conftest.popen_script``, ``RankServer.script``): the exit tests'
ranks (tests/python/exit_paths.py, exit_stress.py, faults_workers.py) and the
ecosystem scripts' launches, which were each a new Python importing torch and
torch._dynamo (40 of them for the exit stress test alone). Their server
imports only what the script itself imports before its process group exists,
in the script's order: torch; pygraph_dist where the script imports it before
its own ``init_process_group``; torch._dynamo only where ``pgd.init()`` imports
it first (imported after the group, it pins the group: what the exit tests
are about). The fork then becomes what ``python SCRIPT ARGS`` started by
``subprocess.Popen`` would be:

* the script runs as ``__main__`` (its ``__file__``, ``sys.argv``, ``sys.path[0]``
  its own directory, compiled without this file's ``__future__`` flags), with
  the environment, directory, session and stdout/stderr the caller asked for
  (the file descriptors are passed over the socket: a pipe works as with Popen);
* SIGINT and SIGTERM as a new Python has them: KeyboardInterrupt for SIGINT
  unless the caller ignores it, SIGTERM default (or both as a terminal gives
  them, the exit tests' ``default_signals``);
* it ends as the interpreter ends a script: an escaping exception prints its
  traceback (from the script's top level: none of the server's frames) and
  exits 1, KeyboardInterrupt kills the process with SIGINT, SystemExit's code
  is the status, then atexit handlers and finalization -- in which the
  collector sees the server's imports again (``gc.unfreeze()`` after the
  script's atexit handlers), as a new Python's last collections do.

tests/python/test_rank_server.py runs one probe script both ways and checks
that each of these is the same. What differs, and is accepted: the parent
process (the server), ``gc.get_freeze_count()`` while the script runs, and a
script's hash seed and address layout, which it shares with the other scripts
forked from its zygote (below; the two ranks of a launch have zygotes of their
own). The
full exit checks (``python tests/python/exit_stress.py --n 500``) start every
rank as a new Python.

What it does not cover, on purpose: GPU processes (CUDA and the GPU timings
keep plain processes), ranks expected to fail in ``run_ranks``, launchers
(torchrun, mpirun, srun) and the programs the tests run as a user would
(``pygraph-launch``, the README's commands, the benchmarks' timed workers), and
any test run with ``PGD_TEST_FRESH_RANKS=1`` (every process a new Python
again, to rule this server out when a test misbehaves).

A server is kept per environment, rank included: an environment variable read
at import (``PYGRAPH_DIST_HOST_SPANS``, or ``RANK`` in Lightning) is seen at
import as a new rank would see it, because ranks whose environment differs (in
anything but ``MASTER_PORT``) get servers of their own. A server is itself a
fork of a zygote, a server that imported only as much of torch,
torch.distributed and torch._dynamo as its preload list starts with. Those
read none of the launcher's rank and address variables, nor pygraph_dist's,
Hugging Face's or the tests' own (``import_inert``; test_rank_server.py checks
what they look up at import), so one zygote serves every environment that
differs only in those; the server sets its environment before it imports the
rest of its list. There is a zygote per value of the rank variables: the two
ranks of a test still differ in hash seed and address layout, as separate
Pythons do. A run of the CPU suite starts some 50 servers; without zygotes each
was a new Python importing torch. The environments repeat from test to test
because conftest puts the pytest process's environment back after each test
(``environ_restored``: importing Lightning there, for one, sets a variable).
Each rank draws new seeds for torch's and numpy's generators. The server must
stay single-threaded (``fork()`` copies one thread): it checks that after
every import. Before each fork it moves what it imported out of the garbage
collector's sight (``gc.freeze()``): a forked rank's collections then walk
only what the rank made. Without it they walked torch's whole heap (and wrote
to its pages): the CPU suite's forked ranks took 390 CPU-s on the 2-core
machine, 100 with it.

Protocol (JSON lines over a socketpair): the test side sends ``{"op": "spawn",
"id", "module", "argv", "env", "cwd", "log"}``, ``{"op": "script", "id",
"script", "argv", "env", "cwd", "new_session", "sigint_ignored",
"sigterm_ignored", "nfds"}`` (with ``nfds`` file descriptors, stdout and
stderr, as SCM_RIGHTS), ``{"op": "server", "id", "env", "cwd", "preload",
"log", "nfds": 1}`` (a zygote's fork, with its own socket as the file descriptor) and
``{"op": "signal", "pid", "sig"}``; the server answers ``{"id", "pid"}`` (or
``{"id", "error"}``) and reports each exit as ``{"exit": pid, "rc":
returncode}`` (Popen's convention). EOF on the socket (the test process
closed it or died) kills the server's ranks (and a zygote's servers) and ends
it; a server and its ranks also get SIGKILL when the test process dies
(``rank_main.die_with_the_test``, and each fork dies with the process it was
forked from).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.machinery
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = Path(__file__).resolve()
RANK_MAIN = HERE / "rank_main.py"
# What every rank imports: torch._dynamo too (pgd.init imports it before the process
# group exists, and any optimizer would; over 2 s of each rank's start on the CI machine).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "pygraph_dist", "common")
# A script's server imports what the script imports before its process group
# exists, in the script's order (conftest.popen_script): torch; torch and
# pygraph_dist (a script that imports it before its own init_process_group);
# or those and torch._dynamo, which pgd.init() imports before it creates the group.
PRELOAD_TORCH = ("torch", "torch.distributed")
PRELOAD_PGD = (*PRELOAD_TORCH, "pygraph_dist")
PRELOAD_PGD_INIT = (*PRELOAD_PGD, "torch._dynamo")
# A server is forked from a zygote: a server that imported the longest prefix
# of its preload list made of these, in this order (each a fork of the one
# before it, the first a new Python). They read none of IMPORT_INERT's
# variables at import, so a zygote imports them once for every environment
# that differs only in those, and each server sets its own environment before
# it imports the rest (test_rank_server.py checks what torch reads at import).
ZYGOTE_MODULES = ("torch", "torch.distributed", "torch._dynamo")
RANK_NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")
IMPORT_INERT = frozenset({*RANK_NAMES, "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT"})
IMPORT_INERT_PREFIXES = ("PYGRAPH_DIST_", "PGD_", "HF_", "TRANSFORMERS_")


def import_inert(name: str) -> bool:
    """Whether ZYGOTE_MODULES leave ``name`` unread at import."""
    return name in IMPORT_INERT or name.startswith(IMPORT_INERT_PREFIXES)


# ---------------------------------------------------------------- the server

def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _thread_names() -> str:
    """This process's threads by name (/proc/self/task/*/comm): which import started one."""
    names = []
    try:
        for tid in sorted(os.listdir("/proc/self/task")):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    except OSError:
        pass
    return ", ".join(names)


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def _serve(sock: socket.socket) -> tuple[dict, list[int]]:
    """Answer requests until EOF; returns only in a forked rank, with its request
    and the file descriptors that came with it."""
    children: dict[int, str] = {}  # pid: its request's op ("server": a server forked for another environment)
    buf = b""
    passed_fds: list[int] = []
    while True:
        while children:  # reap every rank that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.pop(pid, None)
            _send(sock, {"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        busy = any(op != "server" for op in children.values())  # a rank's end is waited for: look often
        ready, _, _ = select.select([sock], [], [], 0.02 if busy else 0.5)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)  # a script's stdout/stderr come as fds
        passed_fds += fds
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
            fds, passed_fds = passed_fds[:req.get("nfds", 0)], passed_fds[req.get("nfds", 0):]
            # "spawn": the test module first, so that the next rank of this module starts at once.
            # An import that fails is left to the rank, whose log then shows the traceback.
            # A test module's RANK_PRELOAD names what its rank bodies import (transformers, lightning).
            # "script": nothing more; the script imports the rest itself, in its own order.
            # "server": nothing here; the fork sets its environment first (_become_server).
            if req["op"] == "spawn":
                try:
                    module = importlib.import_module(req["module"])
                    for name in getattr(module, "RANK_PRELOAD", ()):
                        importlib.import_module(name)
                except BaseException:  # noqa: BLE001 -- the rank raises it again, in its log
                    pass
            if _threads() > 1:
                _send(sock, {"id": req["id"], "error": f"the server has {_threads()} threads ({_thread_names()}) "
                             f"after importing {req.get('module', 'its preloads')}: fork() would copy only one"})
                for fd in fds:
                    os.close(fd)
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
                for fd in passed_fds:
                    os.close(fd)
                if req["op"] == "server":
                    return _serve(_become_server(req, fds[0]))
                return req, fds
            for fd in fds:  # the rank has them now
                os.close(fd)
            children[pid] = req["op"]
            _send(sock, {"id": req["id"], "pid": pid})


def _become(req: dict, out: int, err: int) -> None:
    """In the forked process, for a rank and a script alike: the environment,
    directory and stdout/stderr a process Popen started would have (``out``
    and ``err`` are closed here), and random generators seeded anew."""
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    # A new Python seeds torch's default generator and numpy's global one at random (the
    # random module reseeds itself after fork): so does each forked process, not the server's.
    sys.modules["torch"].default_generator.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _ready(sock: socket.socket, preload) -> bool:
    """Tell the test side whether this server can fork (one thread after importing ``preload``)."""
    if _threads() > 1:
        _send(sock, {"ready": False, "error": f"{_threads()} threads ({_thread_names()}) after importing "
                     f"{', '.join(preload)}"})
        return False
    _send(sock, {"ready": True})
    return True


def _become_server(req: dict, fd: int) -> socket.socket:
    """In a server forked for another environment (``RankServer(parent=...)``):
    what a new server Popen started would have (its environment, directory and
    log), then the rest of its preload list, imported as a new server imports
    it; returns its socket, "ready" sent."""
    sys.modules["rank_main"].die_with_the_parent()  # the server it was forked from
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _become(req, log, log)
    sock = socket.socket(fileno=fd)
    try:
        for name in req["preload"]:
            importlib.import_module(name)
    except BaseException:  # noqa: BLE001 -- in its log; the test side then starts a new Python
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if not _ready(sock, req["preload"]):
        os._exit(1)
    return sock


def _become_rank(req: dict) -> None:
    """In the forked process: the rank's environment, directory, argv and log, as Popen would set them."""
    fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _become(req, fd, fd)
    sys.argv = [str(RANK_MAIN), *req["argv"]]
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _become_script(req: dict, fds: list[int], path: list[str]) -> types.ModuleType:
    """In the forked process: what ``python SCRIPT ARGS`` would have set up, as
    Popen would have started it; returns the ``__main__`` module to run it in."""
    if req["new_session"]:
        os.setsid()
    _become(req, *fds)
    # A new Python installs KeyboardInterrupt for SIGINT unless it started with SIGINT
    # ignored; it leaves SIGTERM as it found it. Popen's child finds what the test had
    # (or the defaults, with the exit tests' preexec_fn).
    signal.signal(signal.SIGINT, signal.SIG_IGN if req["sigint_ignored"] else signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if req["sigterm_ignored"] else signal.SIG_DFL)
    sys.modules["rank_main"].die_with_the_parent()  # the server (fork() cleared the server's own)
    script = req["script"]
    sys.argv = [script, *req["argv"]]
    sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
    # What the server imported was frozen (gc.freeze() before the fork): a fresh
    # Python's last collections, at exit, walk torch's objects too. Registered
    # first, so it runs after every atexit handler the script registers.
    atexit.register(gc.unfreeze)
    sys.excepthook = _without_server_frames(sys.excepthook)
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main
    return main


def _without_server_frames(hook):
    """The traceback of an exception that escapes the script starts at the
    script's top level, as a new Python prints it, not in server_main."""
    def excepthook(kind, value, tb):
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        if isinstance(value, BaseException):
            value.__traceback__ = tb  # what sys.excepthook prints
        hook(kind, value, tb)
    return excepthook


def server_main(fd: int, preload: tuple[str, ...] = PRELOAD) -> None:
    path = sys.path[1:]  # without this file's directory: a script gets its own
    sys.path.insert(0, str(HERE))
    import rank_main

    rank_main.die_with_the_test()  # the server dies with the test process; each rank with the server
    for name in preload:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    if not _ready(sock, preload):
        return
    req, fds = _serve(sock)
    if req["op"] == "script":
        main = _become_script(req, fds, path)
        with open(req["script"], "rb") as f:
            code = compile(f.read(), req["script"], "exec", dont_inherit=True)  # not this file's __future__
        del req, fds, sock, f
        # As the interpreter runs a script: an exception escapes to it (traceback,
        # exit status 1, or the process killed by SIGINT for KeyboardInterrupt),
        # SystemExit's code is the exit status, then atexit and finalization.
        exec(code, main.__dict__)
        return
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


class ForkedProcess(ForkedRank):
    """A script forked by the server: ``subprocess.Popen``'s interface, as the
    exit tests and the ecosystem scripts' launchers use it (``stdout`` is the
    pipe's read end with ``stdout=PIPE``)."""

    def __init__(self, server: "RankServer", pid: int, args: list[str], stdout, text: bool):
        super().__init__(server, pid, "")
        self.args, self.stdout, self.text = args, stdout, text

    def wait(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self.server.dead:  # its ranks were SIGKILLed with it (_gone)
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.pump(0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        out = b""
        if self.stdout is not None:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout, output=out)
                ready, _, _ = select.select([self.stdout], [], [], 0.05 if left is None else min(left, 0.05))
                if ready:
                    chunk = os.read(self.stdout.fileno(), 1 << 16)
                    if not chunk:
                        break
                    out += chunk
                else:
                    self.server.pump(0)
            self.stdout.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.stdout is None:
            return None, None
        return (out.decode(errors="replace") if self.text else out), None


class RankServer:
    """The test side of one server (one per environment and preload list)."""

    def __init__(self, env: dict, log: Path, timeout: float = 120, preload: tuple[str, ...] = PRELOAD,
                 parent: "RankServer | None" = None):
        """A new Python that imports ``preload`` with ``env``; or, with ``parent``,
        a fork of that server, which sets ``env`` and then imports the rest of
        ``preload`` (ServerPool's zygotes)."""
        ours, theirs = socket.socketpair()
        self.log = log
        self.parent = parent
        try:
            if parent is None:
                with open(log, "w") as f:
                    self.proc = subprocess.Popen(
                        [sys.executable, str(SERVER), str(theirs.fileno()), ",".join(preload)], env=env,
                        pass_fds=[theirs.fileno()], stdout=f, stderr=subprocess.STDOUT, cwd=str(HERE.parents[1]))
            else:
                self.proc = parent._fork_server(theirs, env, preload, log, timeout)
        finally:
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
            if not rank.log:  # a script's output went where its caller sent it
                continue
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

    def script(self, args: list[str], *, env: dict, cwd: str, stdout=None, stderr=None,
               start_new_session: bool = False, default_signals: bool = False, text: bool = False,
               timeout: float = 120) -> ForkedProcess:
        """``subprocess.Popen(args, ...)`` for ``args = [sys.executable, SCRIPT, *ARGV]``:
        the script runs as ``__main__`` in a fork of this server. ``stdout``:
        None (this process's), PIPE or a file; ``stderr``: None, STDOUT or a file.
        ``default_signals``: SIGINT and SIGTERM as a terminal gives them, whatever
        this process has (a Popen ``preexec_fn`` that resets them)."""
        if self.dead:
            raise ServerGone(self._why())
        if args[0] != sys.executable:
            raise ValueError(f"RankServer.script runs Python scripts as {sys.executable} would, not {args[0]}")
        read_end = None
        if stdout == subprocess.PIPE:
            read_fd, out_fd = os.pipe()
            read_end = os.fdopen(read_fd, "rb")
        else:
            out_fd = os.dup(1 if stdout is None else stdout.fileno())
        err_fd = os.dup(out_fd) if stderr == subprocess.STDOUT else os.dup(2 if stderr is None else stderr.fileno())
        ignored = {sig: not default_signals and signal.getsignal(sig) == signal.SIG_IGN
                   for sig in (signal.SIGINT, signal.SIGTERM)}
        self.next_id += 1
        rid = self.next_id
        msg = {"op": "script", "id": rid, "script": str(args[1]), "argv": [str(a) for a in args[2:]], "env": env,
               "cwd": str(cwd), "new_session": start_new_session, "nfds": 2,
               "sigint_ignored": ignored[signal.SIGINT], "sigterm_ignored": ignored[signal.SIGTERM]}
        try:
            socket.send_fds(self.sock, [(json.dumps(msg) + "\n").encode()], [out_fd, err_fd])
        except OSError:
            self._gone()
        finally:
            os.close(out_fd)
            os.close(err_fd)
        try:
            reply = self._wait_for(lambda: self.replies.pop(rid, None), timeout)
            if "error" in reply:
                raise ServerGone(reply["error"])
        except ServerGone:
            if read_end is not None:
                read_end.close()
            raise
        proc = ForkedProcess(self, reply["pid"], [str(a) for a in args], read_end, text)
        self.ranks[reply["pid"]] = proc
        return proc

    def _fork_server(self, sock: socket.socket, env: dict, preload: tuple[str, ...], log: Path,
                     timeout: float) -> ForkedProcess:
        """Fork this server into a server for ``env`` that talks over ``sock``: the
        new server's process, as the part of Popen that RankServer uses."""
        if self.dead:
            raise ServerGone(self._why())
        self.next_id += 1
        rid = self.next_id
        msg = {"op": "server", "id": rid, "env": env, "cwd": str(HERE.parents[1]), "preload": list(preload),
               "log": str(log), "nfds": 1}
        try:
            socket.send_fds(self.sock, [(json.dumps(msg) + "\n").encode()], [sock.fileno()])
        except OSError:
            self._gone()
        reply = self._wait_for(lambda: self.replies.pop(rid, None), timeout)
        if "error" in reply:
            raise ServerGone(reply["error"])
        proc = ForkedProcess(self, reply["pid"], ["rank server", str(log)], None, False)
        self.ranks[reply["pid"]] = proc
        return proc

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


def _default_signals() -> None:
    """In a new Python's child before exec: SIGINT and SIGTERM as a terminal's
    Ctrl-C and torchrun find them (Popen's preexec_fn)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ServerPool:
    """Servers by environment and preload list, most recently used last.

    A server imports with its ranks' environment, except what is set per launch
    (``PER_LAUNCH_ENV`` and a caller's ``per_launch``: nothing reads them at
    import). So each rank of a test has a server of its own (RANK differs:
    Lightning reads it at import). A server is a fork of a zygote (a server
    that imported the longest prefix of its preload list made of
    ``ZYGOTE_MODULES``) that then sets its environment and imports the rest of
    its list. A zygote serves every environment that differs only in
    variables those modules leave unread at import (``import_inert``), per
    value of the rank variables: so the ranks of a test still come from
    different Pythons, with different hash seeds and address layouts, as
    separate Pythons have. Past ``limit`` servers the least recently used one
    is retired; a zygote, once nothing forked from it is kept."""

    PER_LAUNCH_ENV = frozenset({"MASTER_PORT", "PYTEST_CURRENT_TEST", "PGD_TEST_RANKS_PARENT"})

    def __init__(self, limit: int = 8, zygote_limit: int = 12):
        self.limit, self.zygote_limit = limit, zygote_limit
        self.servers: dict[tuple, RankServer] = {}
        self.zygotes: dict[tuple, RankServer] = {}
        self.started = 0  # servers
        self.new_pythons = 0  # of the servers and zygotes, those started as new Pythons

    def key(self, env: dict, preload: tuple[str, ...] = PRELOAD, per_launch: tuple[str, ...] = ()) -> tuple:
        skip = self.PER_LAUNCH_ENV.union(per_launch)
        return preload, tuple(sorted((k, v) for k, v in env.items() if k not in skip))

    def get(self, key: tuple) -> RankServer:
        """The server for ``key`` (``self.key(...)``), started if there is none."""
        server = self.servers.pop(key, None)
        if server is None or server.dead:
            while len(self.servers) >= self.limit:
                self.servers.pop(next(iter(self.servers))).close()
            preload, items = key
            self._retire_zygotes()
            zygote = self._zygote(preload, items)
            try:
                server = self._start(dict(items), preload, zygote)
            except ServerGone:
                if zygote is None:
                    raise
                for zkey in [zkey for zkey, z in self.zygotes.items() if z.dead]:
                    del self.zygotes[zkey]
                server = self._start(dict(items), preload, None)  # this one a new Python
            self.started += 1
        self.servers[key] = server
        return server

    def _start(self, env: dict, preload: tuple[str, ...], parent: RankServer | None) -> RankServer:
        env["PGD_TEST_RANKS_PARENT"] = str(os.getpid())  # a new Python's server dies with us
        fd, log = tempfile.mkstemp(prefix="pgd-rank-server-", suffix=".log")
        os.close(fd)
        server = RankServer(env, Path(log), preload=preload, parent=parent)
        self.new_pythons += parent is None
        return server

    def _zygote(self, preload: tuple[str, ...], items: tuple) -> RankServer | None:
        """The zygote to fork a server for ``preload`` and ``items`` from, started
        (with the zygotes before it) if there is none; None where none serves."""
        n = 0
        while n < min(len(preload), len(ZYGOTE_MODULES)) and preload[n] == ZYGOTE_MODULES[n]:
            n += 1
        if n == 0:
            return None
        ident = tuple((k, v) for k, v in items if k in RANK_NAMES)  # its own hash seed per rank
        env = tuple((k, v) for k, v in items if not import_inert(k))
        parent = None
        for depth in range(1, n + 1):
            zkey = (ZYGOTE_MODULES[:depth], ident, env)
            zygote = self.zygotes.pop(zkey, None)
            if zygote is None or zygote.dead:
                try:
                    zygote = self._start(dict(env), ZYGOTE_MODULES[:depth], parent)
                except ServerGone:
                    return parent
            self.zygotes[zkey] = zygote
            parent = zygote
        return parent

    def _retire_zygotes(self) -> None:
        """Past ``zygote_limit``, the least recently used zygotes that no kept server
        or zygote was forked from."""
        retired = True
        while retired and len(self.zygotes) > self.zygote_limit:
            retired = False
            kept = [*self.servers.values(), *self.zygotes.values()]
            for zkey, zygote in list(self.zygotes.items()):
                if not any(s.parent is zygote for s in kept):
                    del self.zygotes[zkey]
                    zygote.close()
                    retired = True
                    break

    def popen(self, args: list, *, env: dict, preload: tuple[str, ...] = PRELOAD_TORCH,
              per_launch: tuple[str, ...] = (), default_signals: bool = False, fork: bool = True, **kwargs):
        """``subprocess.Popen(args, env=env, **kwargs)`` for ``args = [sys.executable,
        SCRIPT, *ARGV]``: forked by the server for ``env`` and ``preload``
        (``RankServer.script``), or a new Python where ``fork`` is false or no
        server can be had. ``per_launch``: variables of ``env`` that differ
        between launches and that nothing reads at import (MASTER_PORT is one
        already). ``default_signals``: SIGINT and SIGTERM as a terminal gives
        them, whatever this process has (a run in the background ignores SIGINT)."""
        if fork:
            key = self.key(env, preload, per_launch)
            try:
                return self.get(key).script(list(args), env=env, default_signals=default_signals, **kwargs)
            except ServerGone:
                self.drop(key)  # a new Python instead
        if default_signals:
            kwargs["preexec_fn"] = _default_signals
        return subprocess.Popen(args, env=env, **kwargs)

    def drop(self, key: tuple) -> None:
        server = self.servers.pop(key, None)
        if server is not None:
            server.close()

    def close(self) -> None:
        while self.servers:
            self.servers.popitem()[1].close()
        for zkey in sorted(self.zygotes, key=lambda zkey: -len(zkey[0])):  # a zygote's forks before it
            self.zygotes.pop(zkey).close()


if __name__ == "__main__":
    server_main(int(sys.argv[1]), tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else PRELOAD)
