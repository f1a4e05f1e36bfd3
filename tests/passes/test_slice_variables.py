"""slice_variable against Fluid's worked examples (reference §2)."""
from __future__ import annotations

import pytest

from ir.core import Variable
from passes.pass_base import PassError
from passes.slice_variables import slice_variable


@pytest.mark.parametrize("shape,count,min_block,rows", [
    ((1000, 1000), 2, 8192, [500, 500]),
    ((1000, 1000), 3, 8192, [334, 334, 332]),
    ((1000, 1000), 2, 1048576, [1000]),
    ((1000,), 2, 8192, [1000]),
    ((1000, 64), 2, 8192, [500, 500]),
    ((192, 2), 2, 8192, [192]),
    ((3, 10000), 2, 8192, [2, 1]),
])
def test_fluid_examples(shape: tuple[int, ...], count: int, min_block: int, rows: list[int]) -> None:
    blocks = slice_variable([Variable("w", shape=shape)], count, min_block)
    assert [b.rows for b in blocks] == rows
    assert [b.offset_rows for b in blocks] == [sum(rows[:i]) for i in range(len(rows))]
    assert all(b.shape[1:] == shape[1:] for b in blocks)
    if len(rows) == 1:
        assert blocks[0].name == "w"
    else:
        assert [b.name for b in blocks] == [f"w.block{i}" for i in range(len(rows))]


def test_bad_arguments() -> None:
    with pytest.raises(PassError, match="min_block_size"):
        slice_variable([Variable("w", shape=(4,))], 2, 0)
    with pytest.raises(PassError, match="slice_count"):
        slice_variable([Variable("w", shape=(4,))], 0, 1)
