"""``bench/ps_bench.py``'s pieces that need no benchmark run: option parsing (``--skip-jobs``, ``--plot``) and
the ``--plot`` figure's data, built from a results dict shaped as ``main`` returns it (the PNG itself is
written only where matplotlib is importable: it is a bench-only extra)."""
from __future__ import annotations

import pathlib
from typing import Any

import pytest

from bench import plotting
from bench import ps_bench as pb

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def _row(job: str, per_trainer: float, pservers: int = 1, **extra: Any) -> dict[str, Any]:
    return {"job": job, "pservers": pservers, "trainers": 2 if pservers else 1, "per_trainer": per_trainer,
            "paddle": False, "placement": "", **extra}


def _result(rows: list[dict[str, Any]], modes: list[str], paddle: str | None = None) -> dict[str, Any]:
    return {"jobs": rows, "paddle": paddle, "reference_per_trainer": pb.REFERENCE_PER_TRAINER,
            "config": {"data_plane": modes, "batch_size": 512, "quick": False}}


def test_bars_per_job_and_system_with_both_data_planes_and_the_recorded_paddle() -> None:
    rows = [_row("single-process", 20_000.0, pservers=0), _row("1x2 sync", 9_000.0), _row("1x2 sync +shm", 9_500.0),
            _row("1x2 async", 14_000.0), _row("1x2 async +shm", 15_000.0), _row("2x2 geo10", 16_000.0),
            _row("2x2 geo10 +shm", 16_500.0), _row("1x2 hybrid-async", 12_000.0)]
    bars = pb.plot_bars(_result(rows, ["off", "auto"]))
    assert [(b.group, b.series, b.value, b.recorded) for b in bars] == [
        ("single-process", "Flotilla", 20_000.0, False),
        ("1x2 sync", "Flotilla, gRPC", 9_000.0, False), ("1x2 sync", "Flotilla, shm", 9_500.0, False),
        ("1x2 async", "Flotilla, gRPC", 14_000.0, False), ("1x2 async", "Flotilla, shm", 15_000.0, False),
        ("2x2 geo10", "Flotilla, gRPC", 16_000.0, False), ("2x2 geo10", "Flotilla, shm", 16_500.0, False),
        ("1x2 hybrid-async", "Flotilla, gRPC", 12_000.0, False),
        ("1x2 async", "Paddle 2.6.2 PS", pb.REFERENCE_PER_TRAINER, True),  # not measured here: marked
    ]


def test_paddle_measured_in_the_run_replaces_the_recorded_figure() -> None:
    rows = [_row("single-process", 20_000.0, pservers=0), _row("1x2 async", 14_000.0),
            _row("paddle 1x2 async", 8_000.0, paddle=True), _row("1x2 async +token", 13_500.0),
            _row("1x2 async @netns", 11_000.0, placement="@netns")]
    bars = pb.plot_bars(_result(rows, ["auto"], paddle="Paddle 2.6.2"))
    assert [(b.group, b.series, b.value, b.recorded) for b in bars] == [
        ("single-process", "Flotilla", 20_000.0, False), ("1x2 async", "Flotilla, shm", 14_000.0, False),
        ("1x2 async", "Paddle 2.6.2 PS", 8_000.0, False), ("1x2 async", "Flotilla, shm, +token", 13_500.0, False),
        ("1x2 async", "Flotilla, shm, @netns", 11_000.0, False),
    ]


def test_cross_host_jobs_name_their_data_plane(capsys: pytest.CaptureFixture[str]) -> None:
    """``--netns --data-plane both``: the cross-host job with the plane on is the TCP plane's bar and row,
    compared with the same placement on gRPC and with the same job (same plane) on loopback."""
    rows = [_row("single-process", 20_000.0, pservers=0), _row("1x2 async", 14_000.0),
            _row("1x2 async +shm", 18_000.0), _row("1x2 async @netns", 12_000.0, placement="@netns", total=24_000.0),
            _row("1x2 async +tcp @netns", 15_000.0, placement="@netns", cpu_ms_per_kex=40.0, total=30_000.0)]
    bars = pb.plot_bars(_result(rows, ["off", "auto"]))
    assert [(b.group, b.series) for b in bars][-3:-1] == [("1x2 async", "Flotilla, gRPC, @netns"),
                                                          ("1x2 async", "Flotilla, TCP plane, @netns")]
    pb.print_cross_host(rows)
    out = capsys.readouterr().out.splitlines()
    plain = next(line for line in out if line.startswith("1x2 async ") and "+tcp" not in line and "@netns" in line)
    tcp = next(line for line in out if line.startswith("1x2 async +tcp"))
    assert plain.split()[3:6] == ["12,000", "14,000", "0.86"], plain  # against loopback gRPC; no tcp/gRPC
    assert tcp.split()[4:9] == ["15,000", "18,000", "0.83", "1.25", "40.0"], tcp  # loopback shm; 15k / 12k


def test_no_recorded_paddle_bar_without_its_job() -> None:
    bars = pb.plot_bars(_result([_row("single-process", 1.0, pservers=0), _row("2x2 sync", 2.0)], ["off"]))
    assert [b.series for b in bars] == ["Flotilla", "Flotilla, gRPC"]


def test_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = pb.parse_args(["--skip-jobs", "--data-plane", "both"])
    assert args.skip_jobs and args.data_plane == ["off", "auto"] and args.plot == ""
    for argv, words in ((["--plot", "out.svg"], "ending in .png"),
                        (["--plot", "out.png", "--skip-jobs"], "leave out --skip-jobs"),
                        (["--rounds", "0"], "and --rounds must be at least 1")):
        with pytest.raises(SystemExit):
            pb.parse_args(argv)
        assert words in capsys.readouterr().err


def test_plot_writes_a_png_or_says_how_to_get_matplotlib(tmp_path: pathlib.Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "jobs.png"
    if not HAVE_MATPLOTLIB:
        with pytest.raises(SystemExit):
            pb.parse_args(["--plot", str(path)])
        assert "matplotlib is not installed" in capsys.readouterr().err
        with pytest.raises(plotting.PlotUnavailable, match="pip install"):
            plotting.pyplot()
        return
    assert pb.parse_args(["--plot", str(path)]).plot == str(path)
    rows = [_row("single-process", 20_000.0, pservers=0), _row("1x2 async", 14_000.0),
            _row("1x2 async +shm", 15_000.0)]
    pb.plot_jobs(str(path), _result(rows, ["off", "auto"]))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_job_processes_get_the_threads_the_launcher_would_give(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.netns import LOOPBACK, Host

    monkeypatch.setattr(pb, "available_cpus", lambda: 8)
    other = Host("other", "10.0.0.2")
    hosts = [LOOPBACK, LOOPBACK, LOOPBACK, other]  # a pserver and 2 trainers here, a trainer elsewhere
    assert pb.launcher_env({"A": "1"}, hosts, LOOPBACK) == {"A": "1", "PJRT_NPROC": "2"}  # 8 CPUs / 3
    assert pb.launcher_env({}, hosts, other)["PJRT_NPROC"] == "8"
    mine = {"PJRT_NPROC": "5"}
    assert pb.launcher_env(mine, hosts, LOOPBACK) is mine  # the user's setting is kept


def test_rounds_report_each_job_from_its_median_ratio_round() -> None:
    """``--rounds``: a job's ratio is taken against the single-process job of its own round; the row kept is
    the median ratio's, with every round's ratio; the baseline keeps its median-CPU round."""
    def round_rows(local_cpu: float, async_cpu: float, paddle_cpu: float | None) -> list[dict[str, Any]]:
        rows = [_row("single-process", 1.0, pservers=0, cpu_ms_per_kex=local_cpu),
                _row("1x2 async", async_cpu, cpu_ms_per_kex=async_cpu)]
        return rows + ([_row("paddle 1x2 async", 1.0, paddle=True, cpu_ms_per_kex=paddle_cpu)] if paddle_cpu else [])

    rounds = [round_rows(10.0, 14.0, 90.0), round_rows(20.0, 22.0, None), round_rows(12.0, 18.0, 80.0)]
    local, job, paddle = pb.median_rounds(rounds)
    assert local["cpu_ms_per_kex"] == 12.0  # the median of 10, 20, 12
    assert job["cpu_ratio_rounds"] == [1.4, 1.1, 1.5] and job["cpu_ratio"] == 1.4 and job["per_trainer"] == 14.0
    assert paddle["cpu_ratio_rounds"] == [9.0, 80.0 / 12.0]  # it ran in two rounds only
    assert pb.median_rounds(rounds[:1]) == rounds[0]


def test_every_variant_of_a_job_is_compared_with_paddle_on_that_job() -> None:
    """The Paddle figure of a job's data-plane (or trust) variant is Paddle's run of the plain job in this
    run, not the recorded figure; a Geo-SGD job compares with Paddle's async job."""
    rows = [_row("1x2 async", 14_000.0), _row("paddle 1x2 async", 8_000.0, paddle=True),
            _row("1x2 async +shm", 20_000.0), _row("paddle 1x2 sync", 6_000.0, paddle=True)]
    for job, expected in [("1x2 async", 8_000.0), ("1x2 async +shm", 8_000.0), ("1x2 async +token +shm", 8_000.0),
                          ("1x2 geo16 +shm", 8_000.0), ("1x2 sync +shm", 6_000.0)]:
        assert pb.reference(rows, job) == (expected, "this run"), job
    assert pb.reference(rows, "2x2 async +shm") == (pb.REFERENCE_PER_TRAINER, "last measured, not this run")


def test_data_plane_modes_parse_as_sets_or_lists() -> None:
    assert pb.parse_args(["--data-plane", "both"]).data_plane == ["off", "auto"]
    assert pb.parse_args(["--data-plane", "all"]).data_plane == ["off", "auto", "tcp"]
    assert pb.parse_args(["--data-plane", "off,tcp"]).data_plane == ["off", "tcp"]
    assert pb.parse_args([]).data_plane == ["auto"]
    for bad in ("shm", "off,off", ""):
        with pytest.raises(SystemExit):
            pb.parse_args(["--data-plane", bad])


def test_a_job_on_the_tcp_plane_of_one_host_is_its_own_bar_and_gets_a_token() -> None:
    rows = [_row("single-process", 20_000.0, pservers=0), _row("1x2 sync", 9_000.0),
            _row("1x2 sync +shm", 9_500.0), _row("1x2 sync +tcp-plane", 9_200.0)]
    bars = pb.plot_bars(_result(rows, ["off", "auto", "tcp"]))
    assert [(b.group, b.series) for b in bars if b.group == "1x2 sync"] == [
        ("1x2 sync", "Flotilla, gRPC"), ("1x2 sync", "Flotilla, shm"), ("1x2 sync", "Flotilla, TCP plane")]
    args = pb.parse_args(["--data-plane", "all", "--trust"])
    variants = dict(pb.trust_variants(args, {"PATH": "/bin"}))
    assert sorted(variants) == ["", " +shm", " +tcp-plane", " +token", " +token +shm", " +token +tcp-plane"]
    assert variants[" +tcp-plane"]["FLAGS_rpc_data_plane"] == "tcp" and variants[" +tcp-plane"]["FLOTILLA_JOB_TOKEN"]
    assert "FLOTILLA_JOB_TOKEN" not in variants[""] and "FLOTILLA_JOB_TOKEN" not in variants[" +shm"]
