"""patches.py: every change pygraph_dist makes to code it does not own is
registered there, applied through it and undone by it (issue 48, item 4).

CPU only: the whole set is applied and undone, and torch must be exactly as
before (the same function, class and flag objects); and the package is read
(AST) for patch sites outside patches.py.
"""

from __future__ import annotations

import ast
import os
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pygraph_dist
from pygraph_dist.step import clip_route, optim
from pygraph_dist.launch import lifetime
from pygraph_dist.runtime import patches

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "pygraph_dist"


def _torch_as_it_is() -> dict:
    """Identity of everything patches.py may change (region and process scopes)."""
    import torch._functorch.config as functorch_config
    import torch.cuda.random as cuda_random
    from torch._dynamo.callback import callback_handler

    return {
        "nn.utils.clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "nn.utils.clip_grad.clip_grad_norm_": torch.nn.utils.clip_grad.clip_grad_norm_,
        "ProcessGroup.shutdown (stored)": vars(dist.ProcessGroup).get("shutdown"),
        "donated_buffer": functorch_config.donated_buffer,
        "dynamo start callbacks": list(callback_handler.start_callbacks),
        "dynamo end callbacks": list(callback_handler.end_callbacks),
        **{f"{m.__name__}.{n}": getattr(m, n) for m in (torch.cuda, cuda_random)
           for n in ("get_rng_state", "set_rng_state")},
        "torch.tensor": torch.tensor,
        "torch.as_tensor": torch.as_tensor,
        "Tensor.new_tensor (own)": vars(torch.Tensor).get("new_tensor", "inherited"),
        "warnings.filters": list(warnings.filters),
        "sync debug mode": torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None,
        "OMPI_MCA_plm_rsh_agent": os.environ.get("OMPI_MCA_plm_rsh_agent"),
        "torch.optim.SGD": dict(vars(torch.optim.SGD)),
    }


def _same(before: dict, after: dict) -> list[str]:
    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(x is y for x, y in zip(a, b))
        return a is b or (isinstance(a, (int, str)) and a == b)

    return [k for k in before if not same(before[k], after[k])]


def test_every_entry_says_what_why_undo_and_where():
    for key, p in patches.REGISTRY.items():
        assert p.scope in ("process", "region", "object", "read"), key
        assert p.changes and p.why and p.sites and p.checked, key
        assert p.undo or p.scope == "read", f"{key}: a change needs its undo"


def _wakeup_fd() -> int:
    """The signal wakeup fd set now (-1: none), left as it is."""
    import signal

    fd = signal.set_wakeup_fd(-1)
    if fd != -1:
        signal.set_wakeup_fd(fd)
    return fd


def test_the_whole_set_applied_and_undone_leaves_torch_as_it_was():
    was_installed = lifetime._installed  # noqa: SLF001
    lifetime.uninstall()
    patches.undo_all()  # torch as it ships: the state every later wrap() starts from again
    # torch hooks its own class's step at an optimizer's first construction (Optimizer._patch_step_function)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    before = _torch_as_it_is()
    script = types.ModuleType("pgd_test_script")
    script.clip = torch.nn.utils.clip_grad_norm_  # `from torch.nn.utils import clip_grad_norm_` before wrap()
    sys.modules[script.__name__] = script
    try:
        # process scope: what wrap() applies
        clip_route.install()
        lifetime.install()
        assert patches.disable_donated_buffers()
        patches.register_compile_callbacks(lambda *a: None, lambda *a: None)
        assert set(patches.applied()) == {k for k, p in patches.REGISTRY.items() if p.scope == "process"}
        assert torch.nn.utils.clip_grad_norm_ is clip_route.clip_grad_norm_
        assert script.clip is clip_route.clip_grad_norm_
        assert lifetime.installed()
        assert _wakeup_fd() != -1  # Ctrl-C reaches the replay watchdogs
        # region scope: applied and undone around a block
        import torch.cuda.random as cuda_random

        swap = patches.Swap("cuda.rng_state_calls", [(torch.cuda, "get_rng_state", lambda *a: None),
                                                     (cuda_random, "set_rng_state", lambda *a: None)])
        host = patches.Swap("host_tensor_factories", [(torch, "tensor", lambda *a, **k: None),
                                                      (torch.Tensor, "new_tensor", lambda *a, **k: None)])
        assert "new_tensor" in vars(torch.Tensor)
        host.undo()
        swap.undo()
        with patches.ignoring_warning("x"), patches.open_mpi_without_agent(True):
            assert os.environ["OMPI_MCA_plm_rsh_agent"] == "false"
        if torch.cuda.is_available():  # torch.cuda's sync debug mode needs a CUDA build
            with patches.sync_debug_warnings():
                pass
        # object scope: the user's optimizer, not torch's class
        optim.make_graph_aware(opt, engine=None)
        assert isinstance(opt, optim.GraphedOptimizerMixin) and type(opt) is not torch.optim.SGD
    finally:
        lifetime.uninstall()
        patches.undo_all()
        sys.modules.pop(script.__name__, None)
    assert patches.applied() == []
    assert _wakeup_fd() == -1
    assert not _same(before, _torch_as_it_is()), _same(before, _torch_as_it_is())
    assert script.clip is clip_route.ORIGINAL
    if was_installed:
        lifetime.install()


def test_pgd_shutdown_undoes_every_process_patch():
    import pygraph_dist as pgd

    assert not dist.is_initialized()
    clip_route.install()
    lifetime.install()
    pgd.shutdown()
    assert patches.applied() == []
    assert torch.nn.utils.clip_grad_norm_ is patches.TORCH_CLIP_GRAD_NORM
    assert not patches.process_group_shutdown_hooked()


def test_swap_puts_back_what_the_owner_stored():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    swap = patches.Swap("host_tensor_factories", [(Child, "f", lambda self: "ours")])
    assert Child().f() == "ours"
    swap.undo()
    assert "f" not in vars(Child) and Child().f() == "base"  # inherited: deleted again


def test_a_missing_private_attribute_says_so():
    with pytest.raises(patches.PrivateAPIMissing, match=r"has no torch\._C\._nope \(checked on torch 2\.11"):
        patches._private("_nope")()  # noqa: SLF001
    with pytest.raises(AttributeError):  # not a group: not "torch lacks the API"
        patches.group_backend(object(), torch.device("cpu"))
    assert patches.backend_timeout_s(object()) is None


def test_torch_without_get_backend_says_so(monkeypatch):
    import torch.distributed as dist

    monkeypatch.delattr(dist.ProcessGroup, "_get_backend")
    with pytest.raises(patches.PrivateAPIMissing, match="ProcessGroup._get_backend"):
        patches.group_backend(object(), torch.device("cpu"))


def test_graph_safe_backend_of_a_non_group_fails_as_before():
    """Not a process group (or none yet): an error, not None ("a stock backend")."""
    with pytest.raises(AttributeError):
        pygraph_dist.graph_safe_backend(object())


def test_undo_all_goes_on_past_a_failing_undo(caplog):
    done = []
    patches._undo["a"] = lambda: done.append("a")  # noqa: SLF001
    patches._undo["b"] = lambda: 1 / 0  # noqa: SLF001
    patches.undo_all()
    assert done == ["a"] and patches.applied() == [], done
    assert "could not undo patch 'b'" in caplog.text


# ------------------------------------------------ the rule, read from the source
_SETTERS = {"simplefilter", "filterwarnings", "set_sync_debug_mode", "putenv", "set_default_dtype",
            "set_default_device", "use_deterministic_algorithms", "set_float32_matmul_precision"}
# Sites another helper owned while this rule was written; each should call patches.py.
_KNOWN = {("integrations/", "_set_default_backend"):
          "Lightning's init_process_group, as launch_env.init(): should call patches.set_default_backend_custom"}


def _torch_names(tree: ast.AST) -> set[str]:
    """Names a module binds to torch modules or their attributes (import aliases)."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _violations(rel: str, source: str) -> list[str]:
    tree = ast.parse(source)
    torch_names = _torch_names(tree)
    out = []

    # A filter set inside `with warnings.catch_warnings()` is put back at its end: not process-wide.
    scoped = [(w.lineno, w.end_lineno) for w in ast.walk(tree) if isinstance(w, ast.With)
              and any("catch_warnings" in ast.unparse(i.context_expr) for i in w.items)]

    def bad(node, what, key=None):
        if not any(rel.startswith(prefix) and key == name for prefix, name in _KNOWN):
            out.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else
                   node.targets if isinstance(node, ast.Delete) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "__class__":
                bad(t, "assigns __class__")
            elif isinstance(t, ast.Attribute) and _root(t) in torch_names:
                bad(t, f"assigns {ast.unparse(t)}")
            elif isinstance(t, ast.Subscript) and ("f_globals" in ast.unparse(t.value)
                                                   or ast.unparse(t.value) == "os.environ"):
                bad(t, f"writes {ast.unparse(t.value)}[...]")
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("setattr", "delattr") and node.args and _root(node.args[0]) in torch_names:
                bad(node, f"{name}() on {ast.unparse(node.args[0])}")
            elif name in _SETTERS and not (name in ("simplefilter", "filterwarnings")
                                           and any(a <= node.lineno <= b for a, b in scoped)):
                bad(node, f"calls {name}()")
            elif (isinstance(fn, ast.Attribute) and ast.unparse(fn.value) == "os.environ"
                  and name in ("pop", "setdefault", "update", "clear")):
                bad(node, f"os.environ.{name}()")
            elif name in ("items", "values", "keys") and isinstance(fn, ast.Attribute) \
                    and ast.unparse(fn.value) == "sys.modules":
                bad(node, "walks sys.modules")
        if isinstance(node, ast.Attribute) and (node.attr in patches.PRIVATE_NAMES or any(
                "." in n and ast.unparse(node).endswith(n) for n in patches.PRIVATE_NAMES)):
            bad(node, f"reads {ast.unparse(node)}", node.attr)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for part in [p for m in modules for p in m.split(".")] + names:
                if part in patches.PRIVATE_NAMES:
                    bad(node, f"imports {part}", part)
    return out


def test_no_patch_site_outside_patches_py():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "patches.py"]
    assert len(files) > 40
    found = [v for p in files for v in _violations(p.relative_to(PACKAGE).as_posix(), p.read_text())]
    assert not found, "change torch through python/pygraph_dist/runtime/patches.py (and register it there):\n" \
        + "\n".join(found)


def test_the_check_sees_each_kind_of_site():
    source = (
        "import os, sys, warnings\nimport torch\nimport torch.distributed as dist\n"
        "from torch._functorch import config\n"
        "torch.nn.utils.clip_grad_norm_ = None\ndist.ProcessGroup.shutdown = None\n"
        "setattr(torch.cuda, 'get_rng_state', None)\nobj.__class__ = int\n"
        "frame.f_globals['x'] = 1\nos.environ['A'] = 'b'\nwarnings.simplefilter('always')\n"
        "list(sys.modules.items())\ng._get_backend(d)\ntorch._C._pop_torch_function_stack()\n"
        "with warnings.catch_warnings():\n    warnings.simplefilter('ignore')\n")  # scoped: fine
    found = _violations("probe.py", source)
    assert sorted({int(v.split(":")[1]) for v in found}) == list(range(4, 15)), found
