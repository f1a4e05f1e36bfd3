"""Golden text tests: the whole printed ProgramSet for each configuration of the acceptance list."""
from __future__ import annotations

from typing import Any

import pytest

from tests.transpiler.test_distribute_transpiler import build_fc, transpile
from transpiler import DistributeTranspilerConfig, HashName

EPS1 = "127.0.0.1:6174"
EPS2 = "127.0.0.1:6174,127.0.0.1:6175"
EPS3 = "127.0.0.1:6174,127.0.0.1:6175,127.0.0.1:6176"

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync_2ps_2tr": ({}, {}),
    "async_2ps_2tr": ({}, {"sync_mode": False}),
    "sync_1ps_1tr": ({}, {"pservers": EPS1, "trainers": 1}),
    "sync_3ps_4tr": ({}, {"pservers": EPS3, "trainers": 4, "trainer_id": 3}),
    "no_slice": ({}, {"config": DistributeTranspilerConfig(slice_var_up=False)}),
    "large_min_block": ({}, {"config": DistributeTranspilerConfig(min_block_size=1048576)}),
    "hash_name": ({}, {"pservers": EPS3, "config": DistributeTranspilerConfig(split_method=HashName)}),
    "lr_exponential": ({"lr": "exp"}, {}),
    "lr_piecewise": ({"lr": "piecewise"}, {}),
    "l2_clip": ({"l2_clip": True}, {}),
    "momentum": ({"opt": "momentum"}, {}),
    "adam": ({"opt": "adam"}, {}),
    "rmsprop": ({"opt": "rmsprop"}, {}),
    "sparse_embedding": ({"sparse_emb": True}, {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str, golden: Any) -> None:
    build_kw, kw = CASES[case]
    golden.check(f"{case}.txt", transpile(*build_fc(**build_kw), **{"pservers": EPS2, **kw}).program_set.to_string())
