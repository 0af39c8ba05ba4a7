"""pygraph-launch command lines, the main job end to end, and the benchmark harness (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import NO_MULTICAST, ROOT, child_env
from pygraph_dist.launch.cli import build_command, parse


def _cmd(argv):
    return build_command(parse(argv))


def test_torchrun_command():
    cmd, env = _cmd(["-n", "2", "train.py", "--steps", "5"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "train.py", "--steps", "5"]
    assert env == NO_MULTICAST


def test_mpirun_never_binds_a_rank_to_one_core():
    cmd, env = _cmd(["--launcher", "mpirun", "-n", "2", "train.py"])
    assert "--bind-to" in cmd and cmd[cmd.index("--bind-to") + 1] == "none"
    for k in NO_MULTICAST:  # exported to the ranks
        assert cmd[cmd.index(k) - 1] == "-x"
    if os.geteuid() == 0:
        assert "--allow-run-as-root" in cmd


def test_mpich_and_srun_commands(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    cmd, _ = _cmd(["--launcher", "mpich", "-n", "4", "train.py"])
    assert cmd[:3] == ["/usr/bin/mpiexec", "-n", "4"] and "-genv" in cmd
    cmd, _ = _cmd(["--launcher", "srun", "-n", "8", "--nodes", "2", "--cpus-per-rank", "4", "train.py"])
    assert "--cpu-bind=cores" in cmd and "--cpus-per-task" in cmd
    cmd, _ = _cmd(["--launcher", "srun", "-n", "2", "train.py"])
    assert "--cpu-bind=none" in cmd


def test_torchrun_multinode_needs_endpoint():
    with pytest.raises(SystemExit, match="rdzv-endpoint"):
        _cmd(["--nodes", "2", "-n", "2", "train.py"])


def test_main_job_runs_on_two_ranks():
    p = subprocess.run([sys.executable, "-m", "pygraph_dist.launch", "-n", "2", "examples/train_mlp.py",
                        "--steps", "12", "--log-every", "6"], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "step   12/12" in p.stdout
    summary = [line for line in p.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and "2 ranks" in summary[0], p.stdout


@pytest.mark.slow
def test_benchmark_harness_smoke(tmp_path):
    pytest.importorskip("matplotlib", reason="the benchmark's plots need matplotlib (setup installs it where pip has an index)")
    p = subprocess.run([sys.executable, "benchmarks/bench_scaling.py", "--workloads", "tiny", "--world-sizes", "1,2",
                        "--conditions", "baseline,jitter", "--iters", "12", "--out-dir", str(tmp_path),
                        "--name", "smoke", "--row-timeout", "150",
                        "--wrap-kwargs", '{"bucket_cap_mb": 0.001}'], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((tmp_path / "smoke.json").read_text())
    ok = {(c["mode"], c["world_size"], c["condition"]): c for c in result["cells"] if c["status"] == "ok"}
    for mode in ("ddp", "pgd"):
        for n in (1, 2):
            c = ok[(mode, n, "baseline")]
            assert len(c["per_rank_ms"]) == n and all(len(r) == 12 for r in c["per_rank_ms"])
            assert c["ms_per_it"] > 0 and "scaling_efficiency" in c and "speedup_vs_ddp" in c
        assert "jitter_throughput_loss" not in ok[(mode, 2, "jitter")]  # no sync10 reference in this run
    # --wrap-kwargs reached wrap(): 1 KB buckets split the tiny net's gradients
    assert ok[("pgd", 2, "baseline")]["pgd_buckets"] > 3
    assert result["config"]["wrap_kwargs"] == '{"bucket_cap_mb": 0.001}'
    skipped = [c for c in result["cells"] if c["status"] == "skipped"]
    assert skipped and all(c["reason"] == "needs CUDA" for c in skipped)
    assert "ms/it" in p.stdout and "speedup" in p.stdout  # the table, with its column definitions
    assert (tmp_path / "smoke-speedup.png").stat().st_size > 1000
    assert (tmp_path / "smoke-efficiency.png").exists()


def test_sweep_variant_specs():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sweep import parse_variant

    assert parse_variant("base") == {"name": "base", "env": {}, "wrap_kwargs": {}}
    assert parse_variant("ctas:NCCL_MAX_CTAS=4,NCCL_PROTO=Simple") == {
        "name": "ctas", "env": {"NCCL_MAX_CTAS": "4", "NCCL_PROTO": "Simple"}, "wrap_kwargs": {}}
    assert parse_variant('b50:{"bucket_cap_mb": 50}')["wrap_kwargs"] == {"bucket_cap_mb": 50}
    both = parse_variant('x:A=1:{"bucket_cap_mb": 5, "select": false}')
    assert both["env"] == {"A": "1"} and both["wrap_kwargs"] == {"bucket_cap_mb": 5, "select": False}
    for bad, why in [("x:A", "not VAR=VALUE"), ("x:{[1]}", "not JSON"), ('x:{"a": 1', "not JSON"),
                     ("x y", "name"), ('x{"a": 1}', "NAME:")]:
        with pytest.raises(SystemExit, match=why):
            parse_variant(bad)


@pytest.mark.slow
def test_sweep_runs_each_variant_with_its_settings(tmp_path):
    """benchmarks/sweep.py: each variant's environment reaches the ranks (recorded
    in the results' settings) and its wrap() arguments reach wrap() (bucket count)."""
    pytest.importorskip("matplotlib", reason="the sweep's plot needs matplotlib")
    p = subprocess.run([sys.executable, "benchmarks/sweep.py", "--variant", "base",
                        "--variant", 'small:PYGRAPH_DIST_FAST_CASTS=0:{"bucket_cap_mb": 0.001}',
                        "--name", "sw", "--out-dir", str(tmp_path), "--no-repeat",
                        "--workloads", "tiny", "--world-sizes", "1,2", "--modes", "pgd",
                        "--conditions", "baseline", "--iters", "6", "--no-floor"],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((tmp_path / "sw.json").read_text())
    base, small = result["variants"]
    assert result["complete"] and [base["name"], small["name"]] == ["base", "small"]
    assert "PYGRAPH_DIST_FAST_CASTS" not in base["settings"]
    assert small["settings"]["PYGRAPH_DIST_FAST_CASTS"] == "0"
    for v in (base, small):
        assert sorted(c["world_size"] for c in v["cells"] if c["status"] == "ok") == [1, 2], v
    buckets = {v["name"]: {c["pgd_buckets"] for c in v["cells"]} for v in (base, small)}
    assert max(buckets["base"]) < min(buckets["small"]), buckets
    assert "small" in p.stdout and "vs ref" in p.stdout
    assert (tmp_path / "sw.png").stat().st_size > 0


def test_profile_replay_timeline_arithmetic():
    # benchmarks/profile_replay.py's reading of a kernel timeline (the GPU run is not testable here).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_replay as pr
    finally:
        sys.path.pop(0)
    assert pr.union([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == 4.0
    # all-reduce [0,4] overlapped by compute [1,2] and [3,6]: 2 exposed; [5,7] by [3,6]: 1 exposed
    assert pr.exposed([(0, 4), (5, 7)], [(1, 2), (3, 6)]) == 3.0
    assert pr.exposed([(0, 1)], []) == 1.0
    assert pr.category("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "nccl"
    assert pr.category("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>") == "optimizer"
    assert pr.category("triton_poi_fused__to_copy_1") == "other"  # inductor's fused kernels are not optimizer
    assert pr.category("nvjet_sm90_tst_64x32_64x16_4x2_h_bz_NNT") == "gemm"
    assert pr.category("Memcpy DtoD (Device -> Device)") == "copy"


def test_sharded_test_runner_reports_a_failing_file(tmp_path):
    """run-all.sh's many-core path (tests/run_sharded.py): every file runs, a
    failing one fails the run and its log is shown, the GPU pass still runs."""
    (tmp_path / "test_good.py").write_text("import pytest\n\n\ndef test_a():\n    assert 1 + 1 == 2\n\n\n"
                                           "def test_b():\n    pytest.skip('the reason is shown')\n")
    (tmp_path / "test_bad.py").write_text("def test_c():\n    assert 'shown' == 'in the log'\n")
    (tmp_path / "test_gpu_only.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_d():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: x\n    multigpu: x\n")
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "run_sharded.py"), "--jobs", "2", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=child_env())
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "test_good.py" in out and "the reason is shown" in out
    assert "FAIL" in out and "'shown' == 'in the log'" in out, out
    assert "CPU tests: 1 passed, 1 skipped, 1 failed" in out or "CPU tests: 1 failed, 1 passed, 1 skipped" in out, out
    assert "GPU tests" in out, out
    last = [ln for ln in out.splitlines() if ln.startswith("== all tests:")]
    assert last and last[-1].startswith("== all tests: FAILED: test_bad.py ("), out  # only that file


def test_sharded_runner_knows_the_test_files():
    """Its longest-first list names files that exist (a rename would silently reorder)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import run_sharded
    finally:
        sys.path.pop(0)
    names = {f.name for f in run_sharded.ordered_files()}
    assert set(run_sharded.LONGEST_FIRST) <= names
    assert run_sharded.summary_line("x\n==== 3 passed, 1 skipped in 2.0s ====\n") == "3 passed, 1 skipped in 2.0s"
    assert run_sharded.summary_line("=== 1 failed, 2 passed in 61.33s (0:01:01) ===") == \
        "1 failed, 2 passed in 61.33s (0:01:01)"
    # A pytest that died before its summary: no stray 'passed' line counts.
    assert run_sharded.summary_line("3 passed checks\nSegmentation fault\n") == "(no summary line)"


def test_open_mpi_agent_only_where_nothing_else_is_configured(tmp_path, monkeypatch):
    """pygraph-launch names `false` as Open MPI's launch agent only with no
    ssh/rsh on PATH and no agent or hostfile chosen (environment or the user's
    MCA parameter file): a configured multi-host setup is never overridden."""
    from pygraph_dist.launch.cli import open_mpi_needs_agent

    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("OMPI_MCA_plm_rsh_agent", "OMPI_MCA_orte_rsh_agent", "PRTE_MCA_plm_ssh_agent",
              "OMPI_MCA_orte_default_hostfile", "OMPI_MCA_rmaps_default_hostfile", "PRTE_MCA_hostfile",
              "OPAL_PREFIX"):
        monkeypatch.delenv(k, raising=False)
    assert open_mpi_needs_agent()
    args = parse(["--launcher", "mpirun", "-n", "2", "train.py"])
    monkeypatch.setattr("shutil.which", lambda p, *a, **k: f"/usr/bin/{p}" if p == "mpirun" else None)
    cmd, _ = build_command(args)
    assert cmd[cmd.index("--mca") + 1:cmd.index("--mca") + 3] == ["plm_rsh_agent", "false"], cmd

    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", str(tmp_path / "hosts"))
    assert not open_mpi_needs_agent()  # other hosts: leave Open MPI's own error
    monkeypatch.delenv("OMPI_MCA_orte_default_hostfile")
    (tmp_path / ".openmpi").mkdir()
    (tmp_path / ".openmpi" / "mca-params.conf").write_text("# site agent\nplm_rsh_agent = /opt/agent\n")
    assert not open_mpi_needs_agent()
    assert "plm_rsh_agent" not in build_command(args)[0]
    (tmp_path / ".openmpi" / "mca-params.conf").write_text("# plm_rsh_agent = /commented/out\n")
    assert open_mpi_needs_agent()
