"""orchard-bench, the README's benchmark helpers (benchmarks/) and the benchmark notebook, at
tiny sizes (timings are not checked here: benchmarks are not timed tests)."""
import json
import os
import threading

import orchard_ops
import pytest

from conftest import REPO_ROOT, run_python


def test_bench_cli_json_and_table(tmp_path):
    out = tmp_path / "bench.json"
    r = run_python("""
        from orchard.cli import bench
        bench.main(["--quick", "--dtypes", "float32", "--json", %r])
    """ % str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["sgemm_gflops"] > 0
    backends = {row["backend"] for row in report["results"]}
    assert "orchard" in backends and "numpy-reference" in backends
    for row in report["results"]:
        assert row["fwd_ms"] > 0 and row["fwd_gflops"] > 0
        if row["backend"] == "orchard":
            assert row["bwd_ms"] > 0
    assert any(" faster than " in line for line in report["comparisons"])
    assert "GFLOP/s" in r.stdout
    # medians of at least three timings, and --quick says its figures are indicative only
    assert report["repeats"] >= 3 and report["indicative_only"] is True
    assert r.stdout.startswith("--quick: tiny shapes and 3 repeats; the figures and ratios "
                               "are indicative only")
    assert "every figure is the median of 3 timings" in r.stdout


def test_medians_need_three_timings():
    from orchard import benchmark

    with pytest.raises(ValueError, match="'repeats' must be >= 3, got 1"):
        benchmark.median_time(lambda: None, 1)
    calls = []
    assert benchmark.median_time(lambda: calls.append(1), 3) >= 0
    assert len(calls) == 4                  # one warm-up call, then three timed


def test_a_shape_must_fit_every_array_a_problem_holds(tmp_path, capsys):
    """A shape is refused where the arrays its problem holds at once (20 of float32: the
    operands, orchard's and torch's outputs and gradients, torch's copies) exceed the
    machine's memory; four arrays had been counted, so a shape that passed was killed."""
    from orchard import benchmark
    from orchard.cli import bench

    n = benchmark.physical_memory() // 40 // 64    # 4 arrays: 0.4x the memory; 20: 2x
    with pytest.raises(SystemExit) as exited:
        bench.main(["--shapes", "1,1,%d,64" % n, "--dtypes", "float32"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "orchard-bench: error: argument --shapes: its arrays need "), err


def test_the_reference_is_timed_where_its_scores_fit(monkeypatch):
    """The NumPy reference materialises float64 N x N scores: the grid times it up to N 2048
    where six such arrays take at most half the machine's memory (B 64 H 64 N 2048: 1.4 TB),
    here a machine of 24 GiB."""
    from orchard import benchmark

    monkeypatch.setattr(benchmark, "physical_memory", lambda: 24 << 30)
    assert benchmark.reference_fits(1, 8, 2048)
    assert not benchmark.reference_fits(1, 1, 4096)
    assert not benchmark.reference_fits(64, 64, 2048)
    most = (12 << 30) // (6 * 8 * 256 * 256)    # B x H at N 256: 4096
    assert benchmark.reference_fits(1, most, 256) and not benchmark.reference_fits(1, most + 1,
                                                                                   256)


def test_bench_decode_table(tmp_path):
    out = tmp_path / "bench.json"
    r = run_python("""
        from orchard.cli import bench
        bench.main(["--quick", "--repeats", "4", "--dtypes", "float32", "--devices", "cpu",
                    "--causal", "no", "--decode", "--json", %r])
    """ % str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["repeats"] == 4 and r.stdout.startswith("--quick: tiny shapes and 4 repeats")
    decode = report["decode"]["cpu"]
    assert decode["read_bandwidth_gbs"] > 0
    assert {row["dtype"] for row in decode["results"]} == {"float32"}     # --dtypes
    for row in decode["results"]:
        assert row["orchard_ms"] > 0 and row["torch_ms"] > 0 and row["speedup"] > 0
        assert row["cache_sum_gbs"] > 0 and row["cache_sum_fraction"] > 0
        assert row["orchard_evicted_ms"] > 0 and row["torch_evicted_ms"] > 0
        assert row["evicted_speedup"] > 0
    assert "orchard / bandwidth" in r.stdout and "orchard / same-size sum" in r.stdout
    assert "caches evicted: orchard ms" in r.stdout


def test_update_readme_writes_targets_and_grid(tmp_path):
    """benchmarks/update_readme.py measures the grid and every target figure (at the quick
    shape) and writes them between the markers of a README, with the JSON and the plot; a
    quick run that names no file writes none (its smoke figures replaced the repository's:
    here those of a stand-in benchmarks/ folder beside a README)."""
    pytest.importorskip("matplotlib")
    out, readme, png = tmp_path / "bench.json", tmp_path / "README.md", tmp_path / "plot.png"
    old = "# x\n<!-- bench:start -->\nold\n<!-- bench:end -->\ntail\n"
    readme.write_text(old)
    stand_in = tmp_path / "repo"
    (stand_in / "benchmarks").mkdir(parents=True)
    (stand_in / "README.md").write_text(old)
    r = run_python("""
        import sys
        sys.path.insert(0, %r)
        import update_readme
        update_readme.main(["--quick", "--json", %r, "--readme", %r, "--plot", %r])
        update_readme.HERE = %r
        update_readme.main(["--quick"])
    """ % (os.path.join(REPO_ROOT, "benchmarks"), str(out), str(readme), str(png),
           str(stand_in / "benchmarks")), timeout=600)
    assert r.returncode == 0, r.stderr
    assert os.listdir(stand_in / "benchmarks") == []
    assert (stand_in / "README.md").read_text() == old
    targets = json.loads(out.read_text())["targets"]
    for key in ("fwd_vs_sgemm", "bwd_vs_sgemm", "causal_speedup", "staged_overhead_pct",
                "tiny_call_us", "peak_mib_n16384"):
        assert targets[key] > 0 or key == "staged_overhead_pct", key
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- bench:end -->\ntail\n")
    assert "| target | bound | measured |" in text and "| numpy-reference |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_products_table():
    """benchmarks/products.py builds its C with the machine's cc (as kernel_targets.py builds
    fma_peak.c, which it times too) and prints a row of five timings and ratios per head dim and
    pass (their values are not checked: two rounds)."""
    r = run_python("""
        import sys
        sys.path.insert(0, %r)
        import products
        products.main(["--rounds", "2"])
    """ % os.path.join(REPO_ROOT, "benchmarks"), timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(int(row[0]), row[1].strip()) for row in rows] == [
        (64, "forward"), (64, "backward"), (128, "forward"), (128, "backward")]
    for row in rows:
        assert len(row) == 7 and all(float(x) > 0 for x in row[2:]), row


def test_few_units_table():
    """benchmarks/few_units.py prints a row of timings and ratios against torch per shape,
    grouped-query and causal ones too, and the OpenCL CPU device's backward against the native
    one where there is that device (values not checked: one round); a shape that is not
    B,H,HKV,N,D[,causal] with HKV dividing H is refused by argparse."""
    pytest.importorskip("torch")
    script = """
        import sys
        sys.path.insert(0, %r)
        import few_units
        few_units.main(%r)
    """
    r = run_python(script % (os.path.join(REPO_ROOT, "benchmarks"),
                             ["--shapes", "1,4,1,300,32", "1,2,2,200,16,causal", "--rounds", "1"]),
                   timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| 1,")]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [
        ("1,4,1,300,32", "no"), ("1,2,2,200,16", "yes")]
    cpu_opencl = any(d["id"].startswith("opencl") and d["kind"] == "cpu"
                     for d in orchard_ops.devices())
    for row in rows:      # the OpenCL CPU device's backward where there is one, else "-"
        assert all(float(x) > 0 for x in row[2:8]), row
        assert [x.strip() != "-" for x in row[8:]] == [cpu_opencl] * 2, row
        assert all(float(x) > 0 for x in row[8:] if cpu_opencl), row
    for bad in ("1,4,3,300,32", "1,4,1,300", "1,4,1,300,32,causl"):
        r = run_python(script % (os.path.join(REPO_ROOT, "benchmarks"), ["--shapes", bad]))
        assert r.returncode == 2 and "--shapes" in r.stderr and repr(bad) in r.stderr, r.stderr


def test_bench_has_no_readme_or_target_flags():
    """Regenerating the README is a benchmark helper, not a flag of the installed command."""
    r = run_python("""
        from orchard.cli import bench
        bench.main(["--readme", "README.md"])
    """)
    assert r.returncode == 2 and "unrecognized arguments: --readme" in r.stderr


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    r = run_python("""
        from orchard.cli import bench
        bench.main(["--quick", "--dtypes", "float32", "--causal", "no", "--plot", %r, "--json"])
    """ % str(png), timeout=600)
    assert r.returncode == 0, r.stderr
    # --json without a file: the report alone on stdout
    assert json.loads(r.stdout)["results"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_what_was_timed():
    """float32 non-causal where timed, else another dtype and causal flag, never empty axes."""
    from orchard import benchmark

    rows = [{"dtype": dt, "causal": c} for dt in ("bfloat16", "float16") for c in (True, False)]
    assert benchmark.plot_kind(rows) == ("bfloat16", False)
    assert benchmark.plot_kind(rows[:1]) == ("bfloat16", True)
    assert benchmark.plot_kind(rows + [{"dtype": "float32", "causal": True}]) == ("float32", True)
    assert benchmark.plot_kind(rows + [{"dtype": "float32", "causal": False}]) == ("float32", False)


def test_bench_plot_into_a_fifo_named_without_a_suffix(tmp_path):
    """A device or FIFO (/dev/null) is written itself, in PNG: /dev/null.png was written
    beside /dev/null, and with --overwrite matplotlib refused the format ''."""
    pytest.importorskip("matplotlib")
    fifo = tmp_path / "plot"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    r = run_python("""
        from orchard.cli import bench
        bench.main(["--quick", "--dtypes", "float32", "--causal", "no", "--devices", "cpu",
                    "--plot", %r, "--overwrite"])
    """ % str(fifo), timeout=600)
    if reader.is_alive():   # (nothing opened it: let the reader go)
        open(fifo, "wb").close()
    reader.join()
    assert r.returncode == 0, r.stderr
    assert got[0][:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "plot.png").exists()


def test_notebook_runs(tmp_path):
    """Executes the notebook's code cells in order, as a kernel would, at tiny sizes."""
    pytest.importorskip("matplotlib")
    nb = os.path.join(REPO_ROOT, "benchmarks", "attention.ipynb")
    r = run_python("""
        import json, os
        os.chdir(%r)
        cells = json.load(open(%r))["cells"]
        scope = {}
        for cell in cells:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), scope)
        print("notebook ok", len(scope["rows"]))
    """ % (str(tmp_path), nb), timeout=900, ORCHARD_BENCH_QUICK=1)
    assert r.returncode == 0, r.stderr
    assert "notebook ok" in r.stdout
    assert (tmp_path / "figures" / "attention_gflops.png").exists()


@pytest.mark.parametrize("sizes, expected", [(["48K", "2048K", "32M"], 128 << 20),
                                             (["32K", "8192K"], 64 << 20),
                                             (["300M"], 1 << 30), ([], 1 << 30),
                                             (["junk"], 1 << 30)])
def test_decode_eviction_sweep_follows_the_cpus_caches(tmp_path, monkeypatch, sizes, expected):
    """The write that evicts the caches before a timed decode step covers four times the
    largest cache Linux lists (at least 64 MiB, at most 1 GiB; 1 GiB where none can be
    read): a small machine's --quick run does not hold 1 GiB."""
    pytest.importorskip("torch")
    from orchard import decode_bench
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / ("index%d_size" % i))
        paths[-1].write_text(size + "\n")
    monkeypatch.setattr(decode_bench.glob, "glob", lambda pattern: [str(p) for p in paths])
    assert decode_bench.evict_bytes() == expected
