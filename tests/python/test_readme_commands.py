"""The README's shell commands work as written, in a new shell, after the two commands.

Every command the README shows -- each line of its ``bash`` code blocks, and
each inline code span that starts like a shell command (``pip install ...``,
``./tests/run-all.sh -m ...``, ``source ...``) -- must be handled here:

* ``RUN``: run in a fresh ``bash -c`` from the repository root, after the
  README's own ``source .venv/bin/activate`` line, with an environment whose
  PATH does not contain the virtual environment (as in a new login). The
  README's placeholder script ``train.py`` becomes ``examples/train_mlp.py``
  with a few steps; nothing else of the command is changed, so a launcher that
  is not reachable, or a flag that no longer exists, fails here.
* ``DRY_RUN``: ``pip install`` lines run as written plus ``--dry-run
  --no-index`` (they would rebuild and reinstall the package the two commands
  just built; the dry run resolves the project and its extras from what is
  installed). ``pygraph-launch --launcher srun`` lines run with ``--dry-run``
  where Slurm's ``srun`` is installed.
* ``SKIP``: the two commands themselves and their variants (this test runs
  inside ``./tests/run-all.sh``), what needs a GPU or Slurm, each with its
  reason.

A README command that is in none of them fails ``test_every_readme_command_is_handled``:
a new command in the README needs a line here saying how it is checked.

Where this checkout has no ``.venv`` (the two commands were not run here, or
``PGD_VENV`` moved it) the commands are skipped, with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, child_env, free_port

README = ROOT / "README.md"
VENV = ROOT / ".venv"
ACTIVATE = "source .venv/bin/activate"
SCRIPT = "examples/train_mlp.py --steps 4 --log-every 2"  # stands in for the README's train.py

# How each README command is checked (the command without its comment, spaces collapsed).
RUN = {
    ACTIVATE: "the shell then finds pygraph-launch, torchrun and python in .venv",
    "pygraph-launch --help": "prints the usage",
    "torchrun --nproc-per-node=2 train.py": "2 CPU ranks train",
    "pygraph-launch --launcher mpirun -n 2 train.py": "2 CPU ranks train under Open MPI",
}
DRY_RUN = {
    "pip install --no-build-isolation .": "resolves from what is installed",
    'pip install --no-build-isolation ".[mpi]"': "resolves from what is installed",
    'pip install --no-build-isolation ".[hf]"': "resolves from what is installed",
    'pip install --no-build-isolation ".[lightning]"': "resolves from what is installed",
    "pygraph-launch --launcher srun -n 8 --nodes 2 train.py": "needs Slurm's srun to run; --dry-run where srun exists",
}
SKIP = {
    "./launch/run-main-job.sh": "one of the two commands (setup, then training): run them first, and this test after",
    "./tests/run-all.sh": "the test command itself, which runs this test",
    "PGD_SKIP_CUDA_COMPILE=1 PGD_SKIP_TWO_HOST=1 ./tests/run-all.sh": "the test command itself, which runs this test",
    './tests/run-all.sh -m "gpu or multigpu"': "the test command itself; its GPU part needs CUDA GPUs",
    "source launch/setup-env.sh": "the setup step of the two commands, which ran before this test",
    "python -m sphinx -W -n -b html docs docs/_build/html":
        "test_docs.py::test_docs_build_strict runs this build (with --keep-going, into a temporary folder)",
}
# An inline code span that is a command (a bare name such as `pygraph-launch`, or
# `PGD_SKIP_CUDA_COMPILE=1` on its own, is a mention, not a command).
_SHELL_SPAN = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"  # VAR=value ... first
                         r"(?:\./\S|(?:source|pip|python|pygraph-launch|torchrun|mpirun|srun) )")

LAUNCH_TIMEOUT = 240  # seconds for one 2-rank launch: 2 shared cores, each rank imports torch
SHORT_TIMEOUT = 120

pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT + 60)


def _strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a # outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _key(cmd: str) -> str:
    return " ".join(_strip_comment(cmd).split())


def readme_commands(text: str | None = None) -> list[str]:
    """Every shell command the README shows, in order, as written (comments included)."""
    text = README.read_text() if text is None else text
    out: list[str] = []
    fence = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
    for lang, body in fence.findall(text):
        if lang in ("bash", "sh", "shell", "console"):
            out += [ln.strip() for ln in body.splitlines() if _key(ln)]
    prose = fence.sub("", text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if _SHELL_SPAN.match(span):
            out.append(span)
    seen: set[str] = set()
    return [c for c in out if not (_key(c) in seen or seen.add(_key(c)))]


COMMANDS = readme_commands()


def test_command_extraction():
    """The extraction is not vacuous: blocks, comments, quotes and inline spans."""
    text = ("x `pip install \"a[b]\"` and `pgd.wrap(m)` and `PGD_X=1`\n\n```bash\n"
            "pygraph-launch -n 2 t.py   # a comment\n\n# only a comment\necho '# kept'\n```\n"
            "```python\nimport os\n```\n`A=1 ./run.sh\n  -x`\n")
    assert readme_commands(text) == ["pygraph-launch -n 2 t.py   # a comment", "echo '# kept'",
                                     'pip install "a[b]"', "A=1 ./run.sh -x"]
    assert _key("pygraph-launch -n 2 t.py   # a comment") == "pygraph-launch -n 2 t.py"
    assert len(COMMANDS) >= 8, COMMANDS


def test_every_readme_command_is_handled():
    handled = {**RUN, **DRY_RUN, **SKIP}
    unhandled = [c for c in COMMANDS if _key(c) not in handled]
    assert not unhandled, (
        "README.md shows commands this test does not check; add each to RUN, DRY_RUN or SKIP in "
        f"{Path(__file__).name} (and make it work as written after the two commands):\n  "
        + "\n  ".join(unhandled))


def test_readme_shows_the_launcher_after_activating():
    """The README says how to reach pygraph-launch, and shows its help and a 2-rank launch."""
    keys = [_key(c) for c in COMMANDS]
    assert ACTIVATE in keys, "README.md no longer says `source .venv/bin/activate`: pygraph-launch is only in .venv/bin"
    assert "pygraph-launch --help" in keys
    assert "pygraph-launch --launcher mpirun -n 2 train.py" in keys or "torchrun --nproc-per-node=2 train.py" in keys
    launcher_lines = [i for i, k in enumerate(keys) if k.startswith(("pygraph-launch", "torchrun"))]
    assert keys.index(ACTIVATE) < min(launcher_lines), "the README activates .venv after using its commands"


def _fresh_shell_env() -> dict:
    """A new shell's environment: no virtual environment on PATH or in VIRTUAL_ENV, no launcher variables."""
    env = child_env()
    venvs = {str(VENV.resolve())}
    if env.get("VIRTUAL_ENV"):
        venvs.add(str(Path(env["VIRTUAL_ENV"]).resolve()))
    keep = [p for p in env.get("PATH", "").split(os.pathsep)
            if p and not any(str(Path(p).resolve()).startswith(v + os.sep) for v in venvs)]
    env["PATH"] = os.pathsep.join(keep) or "/usr/local/bin:/usr/bin:/bin"
    for k in ("VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PYTHONHOME", "BASH_ENV", "ENV", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(k, None)
    return env


def _bash(script: str, env: dict, timeout: float) -> tuple[int, str]:
    """``bash -c script`` from the repository root, in its own process group (all of it killed at timeout)."""
    p = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"timed out after {timeout:.0f} s: bash -c {script!r}\n{out[-6000:]}")
    return p.returncode, out


def _prelude() -> str:
    """What the README says to run first in a new shell (its activation line), as the README writes it."""
    return "\n".join(c for c in COMMANDS if _key(c) == ACTIVATE)


def _with_script(cmd: str) -> str:
    key = _key(cmd)
    assert re.search(r"(^| )train\.py$", key), f"expected the README's placeholder train.py at the end: {cmd}"
    return key[: -len("train.py")] + SCRIPT


@pytest.fixture
def venv():
    if not (VENV / "bin" / "activate").is_file():
        pytest.skip(f"no {VENV.relative_to(ROOT)}/bin/activate in this checkout (the two commands were not run "
                    "here, or PGD_VENV put the environment elsewhere): the README's commands assume it")
    return VENV


def _check(cmd: str, rc: int, out: str, script: str, expect: str | None = None) -> None:
    hint = ""
    if rc == 127 or "command not found" in out:
        hint = ("\n(not found in a new shell: the README must say `source .venv/bin/activate` before it, "
                "and the two commands must put the command into .venv/bin)")
    assert rc == 0, f"README command failed (exit {rc}): {cmd}\nran: bash -c {script!r}{hint}\n{out[-6000:]}"
    if expect:
        assert re.search(expect, out), f"README command {cmd!r}: no {expect!r} in its output:\n{out[-6000:]}"


RUN_CASES = [c for c in COMMANDS if _key(c) in RUN]
DRY_CASES = [c for c in COMMANDS if _key(c) in DRY_RUN]
SKIP_CASES = [c for c in COMMANDS if _key(c) in SKIP]


@pytest.mark.parametrize("cmd", RUN_CASES, ids=_key)
def test_run_readme_command(cmd, venv):
    env = _fresh_shell_env()
    key = _key(cmd)
    if key == ACTIVATE:
        script = f"set -e\n{cmd}\ncommand -v pygraph-launch\ncommand -v torchrun\ncommand -v python\n" \
                 "python -c 'import pygraph_dist, torch; print(\"import ok\")'"
        rc, out = _bash(script, env, SHORT_TIMEOUT)
        _check(cmd, rc, out, script, "import ok")
        found = out.split()[:3]
        assert all(Path(f).parent == venv / "bin" for f in found), \
            f"after `{ACTIVATE}` the commands are not .venv's: {found}"
        return
    if key == "pygraph-launch --help":
        script = f"set -e\n{_prelude()}\n{cmd}"
        rc, out = _bash(script, env, SHORT_TIMEOUT)
        _check(cmd, rc, out, script, r"usage: pygraph-launch .*--launcher")
        return
    # A 2-rank launch on the CPU (this fixture's environment hides GPUs from tests not marked gpu).
    if "mpirun" in key:
        if shutil.which("mpirun", path=env["PATH"]) is None:
            pytest.skip("Open MPI's mpirun is not installed here (the two commands install it as root)")
        env["MASTER_PORT"] = str(free_port())  # pygraph-launch forwards it; 29500 may be taken by a parallel test
    else:
        env["PET_MASTER_PORT"] = str(free_port())  # torchrun's --master-port, from the environment
    script = f"set -e\n{_prelude()}\n{_with_script(cmd)}"
    rc, out = _bash(script, env, LAUNCH_TIMEOUT)
    _check(cmd, rc, out, script, r"summary: 2 ranks \(")


@pytest.mark.parametrize("cmd", DRY_CASES, ids=_key)
def test_dry_run_readme_command(cmd, venv):
    env = _fresh_shell_env()
    key = _key(cmd)
    if key.startswith("pygraph-launch"):
        if shutil.which("srun", path=env["PATH"]) is None:
            pytest.skip("needs Slurm's srun (./tests/run-all.sh installs slurm-client as root; "
                        "not with PGD_SKIP_TWO_HOST=1)")
        script = f"set -e\n{_prelude()}\n{_with_script(cmd).replace('pygraph-launch ', 'pygraph-launch --dry-run ', 1)}"
        rc, out = _bash(script, env, SHORT_TIMEOUT)
        _check(cmd, rc, out, script, r"srun --ntasks 8 --nodes 2 .*train_mlp\.py")
        return
    assert "--no-build-isolation" in key, (
        f"README: {cmd!r} builds this checkout in an isolated environment without torch; "
        "it needs --no-build-isolation (the build compiles against the installed torch)")
    script = f"set -e\n{_prelude()}\n{key} --dry-run --no-index"
    rc, out = _bash(script, env, SHORT_TIMEOUT)
    if rc != 0 and re.search(r"No matching distribution found|Could not find a version", out):
        missing = [m.rstrip(";") for m in re.findall(r"No matching distribution found for (\S+)", out)]
        pytest.skip(f"{', '.join(missing) or 'a requirement'} of `{key}` is not installed here, and the dry run "
                    "does not download (./tests/run-all.sh's setup installs the extras' packages)")
    _check(cmd, rc, out, script, r"Would install .*pygraph_dist-")
    assert "does not provide the extra" not in out, f"README command {cmd!r}: pip says:\n{out[-3000:]}"


@pytest.mark.parametrize("cmd", SKIP_CASES, ids=_key)
def test_skipped_readme_command(cmd):
    pytest.skip(f"not run here: {SKIP[_key(cmd)]}")
