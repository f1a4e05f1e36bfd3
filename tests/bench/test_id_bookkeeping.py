"""``bench/id_bookkeeping.py`` runs end to end on a small draw and prints each variant's figure."""
from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_bench_times_every_variant() -> None:
    out = subprocess.run([sys.executable, str(REPO / "bench" / "id_bookkeeping.py"), "--ids", "500", "--rows", "1000",
                          "--reps", "3"], cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "500 ids over 1,000 rows" in out, out
    for variant in ("jnp.unique(size=500) under jit", "runtime.rows.IdSorter", "np.unique(return_inverse=True)"):
        assert variant in out, out
    assert "compiled unique / IdSorter = " in out, out
