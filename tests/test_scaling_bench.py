"""orchard-bench --scaling (orchard.scaling_bench) at its --quick sizes: the report's structure,
every ratio recomputed from the timings it reports, the restriction flags, the naive NumPy
attention against the float64 reference. No timing is checked: benchmarks are not timed
tests."""
import json

import numpy as np
import pytest

from conftest import run_python
from orchard import scaling_bench
from orchard.benchmark import attention_flops
from orchard.reference import ref_bwd, ref_fwd

RUN = """
import json, sys
%s
from orchard.cli import bench
sys.exit(bench.main(%r))
"""


def run_bench(argv, without_torch=False):
    """(the process, the report): orchard-bench with argv and --json on stdout."""
    hide = 'sys.modules["torch"] = None' if without_torch else ""
    r = run_python(RUN % (hide, argv + ["--json", "--quiet"]), timeout=600)
    assert r.returncode == 0, r.stderr
    return r, json.loads(r.stdout)


def check_row(row, report):
    """The row's figures agree with each other and with its round timings."""
    scaling = report["scaling"]
    h = scaling_bench.heads(row["N"], scaling["tokens"])
    assert (row["B"], row["H"]) == (1, h)
    flops = attention_flops(1, h, row["N"], row["D"], row["causal"])
    assert row["gflop"] == pytest.approx(flops / 1e9 * (2.5 if row["direction"] == "bwd" else 1))
    assert row["roofline"] == ("bf16_gemm_gflops" if row["dtype"] == "bfloat16"
                               else "sgemm_gflops")
    for backend, rounds in row["round_ms"].items():
        assert len(rounds) == report["repeats"] and min(rounds) > 0
        assert row["ms"][backend] == pytest.approx(np.median(rounds))
        assert row["gflops"][backend] == pytest.approx(row["gflop"] / row["ms"][backend] * 1e3)
    naive = scaling_bench.naive_fits(h, row["N"], row["dtype"])
    assert ("numpy-naive" in row["ms"]) == naive
    for dev in scaling["devices"]:
        ours = np.array(row["round_ms"]["orchard:" + dev])
        if "torch-sdpa" in row["ms"]:
            theirs = np.array(row["round_ms"]["torch-sdpa"])
            assert row["vs_torch"][dev] == pytest.approx(np.median(theirs / ours))
        assert row["vs_roofline"][dev] == pytest.approx(
            row["gflops"]["orchard:" + dev] / scaling["rooflines"][row["roofline"]])


def test_quick_scaling_run_end_to_end(tmp_path):
    r, report = run_bench(["--scaling", "--quick", "--dtypes", "float32,bfloat16"])
    scaling = report["scaling"]
    assert report["indicative_only"] is True and report["repeats"] == 3
    assert "results" not in report            # the grid is not run
    assert scaling["devices"] == ["cpu"] and scaling["tokens"] == scaling_bench.QUICK_TOKENS
    assert set(scaling["rooflines"]) == {"sgemm_gflops", "bf16_gemm_gflops"}
    assert min(scaling["rooflines"].values()) > 0 and scaling["notes"] == []
    got = [(r["dtype"], r["D"], r["causal"], r["N"], r["direction"]) for r in scaling["rows"]]
    assert sorted(got) == sorted(
        (dtype, d, causal, n, direction)
        for dtype, d, causal, n in scaling_bench.problems(
            scaling_bench.QUICK_NS, scaling_bench.QUICK_HEAD_DIMS, ["float32", "bfloat16"],
            [False, True])
        for direction in ("fwd", "bwd"))
    for row in scaling["rows"]:
        assert {"orchard:cpu", "torch-sdpa"} <= set(row["ms"])
        check_row(row, report)
    # the naive attention at these sizes: in every float32 row, in no bfloat16 row
    assert {row["dtype"] for row in scaling["rows"] if "numpy-naive" in row["ms"]} == {"float32"}


def test_quick_scaling_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "scaling.png", tmp_path / "scaling.json"
    r = run_python(RUN % ("", ["--scaling", "--quick", "--dtypes", "float32", "--causal", "no",
                               "--plot", str(png), "--json", str(out)]), timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("--quick: tiny shapes and 3 repeats")
    report = json.loads(out.read_text())
    # one table per (dtype, D, causal, direction), one line per N, the ratios as reported
    for direction in ("forward", "backward"):
        assert "float32, D=32, non-causal, %s (roofline: NumPy float32 matrix product)" \
            % direction in r.stdout
    header = [line for line in r.stdout.splitlines() if line.startswith("| N | H |")]
    assert len(header) == 2 and "orchard:cpu vs torch" in header[0] \
        and "numpy-naive ms" in header[0]
    for row in report["scaling"]["rows"]:
        cells = "| %d | %d | %.2f | %.1f |" % (row["N"], row["H"], row["ms"]["orchard:cpu"],
                                               row["gflops"]["orchard:cpu"])
        line = next(line for line in r.stdout.splitlines() if line.startswith(cells))
        assert line.endswith("| %.2fx | %.2f |" % (row["vs_torch"]["cpu"],
                                                 row["vs_roofline"]["cpu"]))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["complete"] is True


STOP_AT_SECOND_PROBLEM = """
from orchard import scaling_bench
measure_problem, calls = scaling_bench.measure_problem, []
def stop_at_second(*args):
    calls.append(args)
    if len(calls) == 2:
        raise KeyboardInterrupt     # what Ctrl-C raises there
    return measure_problem(*args)
scaling_bench.measure_problem = stop_at_second
"""


def test_a_stopped_scaling_run_keeps_its_measured_problems(tmp_path):
    """--json FILE is rewritten after each problem: a run stopped in its second problem leaves
    the first one's rows, consistent and marked incomplete, and prints one line."""
    out = tmp_path / "scaling.json"
    r = run_python(RUN % (STOP_AT_SECOND_PROBLEM, [
        "--scaling", "--quick", "--dtypes", "float32", "--causal", "no", "--quiet",
        "--json", str(out)]), timeout=600)
    assert r.returncode == 130 and r.stderr == "orchard-bench: interrupted\n"
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["indicative_only"] is True
    rows = report["scaling"]["rows"]
    assert [(row["N"], row["direction"]) for row in rows] == [(256, "fwd"), (256, "bwd")]
    for row in rows:
        check_row(row, report)
    assert [p.name for p in tmp_path.iterdir()] == ["scaling.json"]    # no temporary left


def test_restriction_flags():
    import orchard_ops

    devices = [d["id"] for d in orchard_ops.devices()]
    _, report = run_bench(["--scaling", "--quick", "--dtypes", "float64", "--causal", "yes",
                           "--head-dims", "16,24", "--max-n", "300", "--devices",
                           ",".join(devices)])
    rows = report["scaling"]["rows"]
    assert report["scaling"]["devices"] == devices
    assert {(r["dtype"], r["causal"], r["N"]) for r in rows} == {("float64", True, 256)}
    assert sorted({r["D"] for r in rows}) == [16, 24] and len(rows) == 4
    for row in rows:
        assert {"orchard:" + dev for dev in devices} <= set(row["ms"])
        assert "numpy-naive" in row["ms"]        # NumPy has float64
        check_row(row, report)


def test_without_torch_the_torch_columns_are_left_out():
    r, report = run_bench(["--scaling", "--quick", "--dtypes", "float32", "--causal", "no",
                           "--max-n", "256"], without_torch=True)
    scaling = report["scaling"]
    assert scaling["notes"] == ["torch is not installed: no torch SDPA columns and no "
                                "bfloat16 matrix product roofline"]
    assert set(scaling["rooflines"]) == {"sgemm_gflops"}
    for row in scaling["rows"]:
        assert set(row["ms"]) == {"orchard:cpu", "numpy-naive"} and row["vs_torch"] == {}
        check_row(row, report)


@pytest.mark.parametrize("causal", [False, True])
def test_naive_attention_matches_the_reference(causal):
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((3, 40, 24)) for _ in range(4))
    np.testing.assert_allclose(scaling_bench.naive_fwd(q, k, v, causal),
                               ref_fwd(q, k, v, causal=causal)[0], rtol=1e-12, atol=1e-12)
    for got, ref in zip(scaling_bench.naive_bwd(dout, q, k, v, causal),
                        ref_bwd(dout, q, k, v, causal=causal)):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_work_and_naive_rules():
    """The rules the README states: every call holds TOKENS rows, two heads at the largest N;
    the naive attention up to N = 2048 in float32 and 1024 in float64, never in half types."""
    assert [scaling_bench.heads(n) * n for n in scaling_bench.NS] == \
        [scaling_bench.TOKENS] * len(scaling_bench.NS)
    assert scaling_bench.heads(scaling_bench.NS[-1]) == 2
    largest = {dtype: max([n for n in scaling_bench.NS
                           if scaling_bench.naive_fits(scaling_bench.heads(n), n, dtype)],
                          default=None)
               for dtype in ("float32", "float64", "float16", "bfloat16")}
    assert largest == {"float32": 2048, "float64": 1024, "float16": None, "bfloat16": None}
