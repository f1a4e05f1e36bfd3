"""``bench/collective_bench.py``'s pieces that need no full benchmark run: option parsing, the bus-bandwidth
formula, the comparison table (on given figures), the recorded torch figures ``--vs-torch`` prints without
torch (checked in an interpreter that cannot import torch), and, when torch is importable (the ``bench``
extra), the torch twins of the examples (same parameter shapes as the examples' programs) and a torch
gloo allreduce and DDP step run by the bench's own workers over 127.0.0.1.
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest

from bench import collective_bench as cb

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_options() -> None:
    args = cb.parse_args(["--vs-torch", "--plot", "out.png", "--json", "f.json", "--quick"])
    assert (args.vs_torch, args.plot, args.json, args.quick, args.rounds) == (True, "out.png", "f.json", True, 3)
    assert not cb.parse_args([]).vs_torch


def test_dgc_options() -> None:
    args = cb.parse_args(["--dgc"])
    assert (args.dgc, args.dgc_steps, args.dgc_lr, args.dgc_clip, args.dgc_nesterov) == (True, 300, 0.01, 1.0, True)
    args = cb.parse_args(["--dgc", "--dgc-clip", "0", "--no-dgc-nesterov"])
    assert (args.dgc_clip, args.dgc_nesterov) == (0.0, False)


def test_dgc_variants_start_from_the_same_parameters() -> None:
    """The reference values cover every parameter of a dense and a DGC build, with their shapes, and do
    not depend on the build (the variants' own startup programs would draw other values)."""
    from examples.transformer import train
    from flotilla.fluid import optimizer

    args = train.parse_args(["--batch-size", "32", "--layers", "1"])
    first, again = cb._initial_parameters(args), cb._initial_parameters(args)
    for make in (lambda: optimizer.Momentum(0.01, 0.9),
                 lambda: optimizer.DGCMomentumOptimizer(0.01, 0.9, rampup_begin_step=0)):
        params = cb._dgc_model(args, make).main.all_parameters()
        assert sorted(first) == sorted(p.name for p in params)
        assert all(first[p.name].shape == tuple(p.shape) for p in params)
    assert all((first[k] == again[k]).all() for k in first) and first["word_emb"].std() > 0.01


@pytest.mark.parametrize("argv, message", [(["--plot", "out.svg"], "ending in .png"),
                                           (["--rounds", "0"], "--rounds must be >= 1"),
                                           (["--dgc-clip", "-1"], "--dgc-clip >= 0"),
                                           (["--dgc-lr", "0"], "--dgc-lr > 0")])
def test_bad_options_name_the_problem(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cb.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bus_bandwidth_is_the_ring_volume_over_time() -> None:
    assert cb.bus_bandwidth(4_000_000_000, 2.0, 2) == pytest.approx(2.0)  # 2 ranks: bytes / time
    assert cb.bus_bandwidth(4_000_000_000, 2.0, 4) == pytest.approx(3.0)  # x 2(n-1)/n = 1.5


FLOTILLA = {"allreduce_4MiB_n2": 0.5, "allreduce_64MiB_n2": 0.6, "resnet_n1": 600.0, "resnet_n2": 720.0,
            "resnet_n4": 540.0}
TORCH = {"allreduce_4MiB_n2": 1.0, "allreduce_64MiB_n2": 1.2, "resnet_n1": 800.0, "resnet_n2": 800.0}


def test_rows_pair_figures_and_derive_scaling() -> None:
    rows = {r.key: r for r in cb.comparison_rows(FLOTILLA, TORCH, True, {"resnet_n2": 3.5, "resnet_n4": 4.0})}
    assert list(rows) == ["allreduce_4MiB_n2", "allreduce_64MiB_n2", "resnet_n1", "resnet_n2", "resnet_n4",
                          "resnet_scaling_n2", "resnet_scaling_n4"]
    assert rows["allreduce_4MiB_n2"].ratio == pytest.approx(0.5)
    assert rows["resnet_scaling_n2"].flotilla == pytest.approx(1.2)
    assert rows["resnet_scaling_n2"].torch == pytest.approx(1.0)
    assert rows["resnet_scaling_n2"].load == 3.5  # the n-process row's load
    assert rows["resnet_n4"].torch is None and rows["resnet_n4"].ratio is None


def test_cpu_per_example_gives_a_load_free_scaling_row() -> None:
    ours = {**FLOTILLA, "resnet_cpu_n1": 400.0, "resnet_cpu_n2": 440.0}
    theirs = {**TORCH, "resnet_cpu_n1": 600.0, "resnet_cpu_n2": 900.0}
    rows = {r.key: r for r in cb.comparison_rows(ours, theirs, True, {"resnet_n2": 3.5})}
    assert "resnet_cpu_n1" not in rows  # the raw figures stay out of the table (lower is better there)
    row = rows["resnet_cpu_scaling_n2"]
    assert (row.flotilla, row.torch) == (pytest.approx(400 / 440), pytest.approx(600 / 900))
    assert row.ratio == pytest.approx((400 / 440) / (600 / 900)) and row.load == 3.5
    runs = [{"examples_per_s": 500.0, "cores": 0.5, "step_s": 0.032}, {"examples_per_s": 500.0, "cores": 1.0,
                                                                         "step_s": 0.032}]
    assert cb._throughput_and_cpu(runs, 32) == (1000.0, pytest.approx(1500.0))  # 48 ms of CPU for 32 examples


def test_table_shows_values_ratios_loads() -> None:
    table = cb.format_table(cb.comparison_rows(FLOTILLA, TORCH, True, {"resnet_n2": 3.5}), "")
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("resnet, 2 processes"))
    assert line.split()[-4:] == ["720", "800", "0.90", "3.5"]
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("resnet, 4 processes"))
    assert line.split()[-4:] == ["540", "-", "-", "-"]
    assert "*" not in table and "NOT MEASURED" not in table


def test_recorded_torch_figures_are_marked() -> None:
    note = cb.recorded_torch_note("torch is not installed")
    table = cb.format_table(cb.comparison_rows(FLOTILLA, cb.RECORDED_TORCH["figures"], False, {}), note)
    recorded = cb.RECORDED_TORCH["figures"]["allreduce_4MiB_n2"]
    line = next(ln for ln in table.splitlines() if ln.strip().startswith("allreduce 4 MiB, 2 processes"))
    assert f"{recorded:.2f}*" in line
    assert table.splitlines()[-1].startswith("   * torch: NOT MEASURED IN THIS RUN (torch is not installed)")


def test_recorded_figures_cover_the_catalogue() -> None:
    keys = {k for k, _, _ in cb.figure_catalog()}
    figures = cb.with_scaling(cb.RECORDED_TORCH["figures"])
    assert set(figures) <= keys
    assert all(isinstance(v, float) and v > 0 and math.isfinite(v) for v in figures.values())


def test_without_torch_vs_torch_prints_the_recorded_figures() -> None:
    """In an interpreter where ``import torch`` fails, the bench finds no torch and its comparison section
    prints the recorded figures, marked, and writes that to the JSON report."""
    code = textwrap.dedent("""
        import json, sys
        sys.modules["torch"] = None  # import torch raises ImportError, as without the bench extra
        from bench import collective_bench as cb
        assert cb.torch_version() is None
        args = cb.parse_args(["--vs-torch"])
        report = {}
        cb.comparison_section(args, cb.torch_version(), 2, {"resnet_n1": 600.0, "resnet_n2": 700.0}, {},
                              cb.Loads(), report, "")
        print("REPORT " + json.dumps(report["vs_torch"]))
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch: recorded figures, NOT measured in this run" in out.stdout
    assert "* torch: NOT MEASURED IN THIS RUN (torch is not installed" in out.stdout
    report = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("REPORT "))[len("REPORT "):])
    assert report["measured_in_this_run"] is False
    assert [r["torch"] for r in report["rows"]][:2] == [cb.RECORDED_TORCH["figures"]["resnet_n1"],
                                                        cb.RECORDED_TORCH["figures"]["resnet_n2"]]


def test_plot_or_say_why_not(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "scaling.png"
    said = cb.plot_scaling(str(path), cb.comparison_rows(FLOTILLA, TORCH, True, {}))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in said and not path.exists()
        return
    assert said == f"plot: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_torch_twins_have_the_examples_parameters(name: str) -> None:
    pytest.importorskip("torch")
    from bench import torch_models

    train = cb._example(name)
    args = train.parse_args([])
    main, _, _, _ = train.build(args)
    fluid = sorted(tuple(sorted(p.shape)) for p in main.all_parameters() if p.trainable)
    model, _ = torch_models.build(name, args)
    assert torch_models.parameter_shapes(model) == fluid


@pytest.mark.serial  # jobs of two torch processes
def test_torch_workers_over_loopback() -> None:
    """The bench's torch workers, as ``--vs-torch`` runs them: a gloo allreduce over 2 processes (each
    worker checks one sum, and fails otherwise) and 2 DDP steps of the Transformer twin."""
    pytest.importorskip("torch")
    ranks = cb.run_job(2, kind="torch_allreduce", reps=1, threads=1, timeout_s=120)
    assert [sorted(r) for r in ranks] == [["4MiB", "64MiB"]] * 2
    assert all(r["64MiB"]["bytes"] == 64 << 20 and r["64MiB"]["torch_s"] > 0 for r in ranks)
    ranks = cb.run_job(2, kind="torch_model", name="transformer", steps=2, batch=8, threads=1, timeout_s=120)
    assert len(ranks) == 2 and all(r["examples_per_s"] > 0 for r in ranks)
