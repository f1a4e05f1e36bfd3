"""LoD (variable-length sequence) feeds: Fluid 1.5's ``create_lod_tensor`` and ``DataFeeder`` (``LoDTensor``,
a value a scope can hold too, lives in ``runtime.scope``), and the representation the executor compiles.

Representation. A ``layers.data(name, ..., lod_level=1)`` variable is fed as two variables:

- ``name``: the rows of every sequence, concatenated (Fluid's flattened LoD tensor, ``[R, ...]``), then
  padded with zero rows up to a *bucket* of ``bucket_rows(R)`` rows (the next power of two, at least
  ``MIN_BUCKET_ROWS``);
- ``seq_len_name(name)`` (``name@SEQ_LEN``, int64 ``[N]``): each sequence's row count, created beside the
  data variable by ``layers.data`` and read by the sequence ops through their ``Length`` slot.

So the compiled step sees shapes that depend only on the bucket and the number of sequences, not on the
lengths: a batch of N sequences recompiles at most once per power of two of its total length (as a dense
feed recompiles per batch size), instead of once per batch. Sequence kernels
(``runtime/kernels/nn.py``) derive segment ids from the lengths and ignore padding rows; row-wise ops
(``embedding``, ``fc``, activations) compute on padding rows harmlessly. Ops that reduce over rows
(``mean``, ``reduce_sum``) would see the padding: pool sequences first, as Fluid programs do. A fetched
LoD intermediate comes back with its padding rows.

Invariants: feeding never changes the program; the lengths always sum to at most the bucket's rows;
a LoD variable fed without lengths fails with a message saying how to feed it.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ir.core import Block, Program, Variable, default_main_program
from ir.names import seq_len_name
from runtime.scope import FeedError, LoDTensor

MIN_BUCKET_ROWS = 8


def bucket_rows(rows: int) -> int:
    """The padded row count for ``rows`` rows: the next power of two, at least ``MIN_BUCKET_ROWS``."""
    return max(MIN_BUCKET_ROWS, 1 << max(rows - 1, 0).bit_length())


def create_lod_tensor(data: Any, recursive_seq_lens: Sequence[Sequence[int]], place: Any = None) -> LoDTensor:
    """Fluid 1.5's ``create_lod_tensor``: ``data`` is an array of all rows, a list of sequences (each a
    list of ids: flattened to int64 ``[R, 1]``) or a LoDTensor; the lengths must add up to its rows."""
    if isinstance(data, LoDTensor):
        data = np.asarray(data)
    elif isinstance(data, list):
        flat = [np.asarray(seq).reshape(-1) for seq in data]
        given = [[len(seq) for seq in flat]]
        if [list(map(int, level)) for level in recursive_seq_lens] != given:
            raise FeedError(f"create_lod_tensor: recursive_seq_lens {list(recursive_seq_lens)} do not match the "
                                 f"sequence lengths of data {given}")
        data = (np.concatenate(flat) if flat else np.zeros(0)).astype(np.int64).reshape(-1, 1)
    data = np.asarray(data)
    t = LoDTensor(data, recursive_seq_lens)
    if not t.has_valid_recursive_sequence_lengths():
        raise FeedError(f"create_lod_tensor: the sequence lengths {t.recursive_sequence_lengths()} add up to "
                             f"{sum(t.recursive_sequence_lengths()[-1])} rows; data has {data.shape[0]}")
    return t


# --- what the executor feeds -------------------------------------------------------------------------------
def is_lod_var(block: Block, name: str) -> bool:
    """Whether ``name`` is a ``lod_level=1`` data variable (it has a lengths variable beside it)."""
    var = block.find_var_recursive(name)
    return var is not None and var.is_data and block.find_var_recursive(seq_len_name(name)) is not None


def _rows_and_lengths(var: Variable, value: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(value, LoDTensor):
        lens = value.recursive_sequence_lengths()
        if not lens:
            raise FeedError(f"feed {var.name!r} is a LoDTensor without sequence lengths, but {var.name!r} has "
                                 "lod_level=1", hint="call t.set_recursive_sequence_lengths([[len_0, ...]])")
        rows = np.asarray(value)
        if not value.has_valid_recursive_sequence_lengths():
            raise FeedError(f"feed {var.name!r}: sequence lengths {lens} add up to {sum(lens[-1])} rows, the "
                                 f"tensor has {rows.shape[0]}")
        return rows, np.asarray(lens[-1], np.int64)
    if isinstance(value, (list, tuple)):
        row_shape = tuple(var.shape[1:])
        seqs = []
        for i, seq in enumerate(value):
            try:
                a = np.asarray(seq, dtype=var.dtype)
            except (TypeError, ValueError) as e:
                raise FeedError(f"feed {var.name!r}: sequence {i} cannot be converted to {var.dtype}: {e}") from None
            seqs.append(a.reshape((-1,) + row_shape))
        lens = np.asarray([s.shape[0] for s in seqs], np.int64)
        rows = np.concatenate(seqs) if seqs else np.zeros((0,) + row_shape, var.dtype)
        return rows, lens
    raise FeedError(f"feed {var.name!r} has lod_level=1 and needs sequence lengths; got a "
                         f"{type(value).__name__} without them",
                         hint=f"feed a list of sequences, create_lod_tensor(data, [lengths], place) or a LoDTensor "
                              f"(or feed the padded rows with {seq_len_name(var.name)!r} yourself)")


def pad_rows(rows: np.ndarray) -> np.ndarray:
    """``rows`` followed by zero rows up to ``bucket_rows(len(rows))``."""
    bucket = bucket_rows(rows.shape[0])
    if bucket == rows.shape[0]:
        return rows
    out = np.zeros((bucket,) + rows.shape[1:], rows.dtype)
    out[:rows.shape[0]] = rows
    return out


def expand_lod_feeds(block: Block, feed: Mapping[str, Any]) -> dict[str, Any]:
    """The executor's feed with every LoD feed replaced by its padded rows and its lengths variable; a
    LoDTensor fed to a variable without LoD becomes its array (its lengths must be empty). Feeds that
    name a lengths variable themselves pass through untouched, as do all other feeds."""
    out: dict[str, Any] = {}
    for name, value in feed.items():
        if is_lod_var(block, name) and seq_len_name(name) not in feed:
            rows, lens = _rows_and_lengths(block.find_var_recursive(name), value)
            out[name] = pad_rows(rows)
            out[seq_len_name(name)] = lens
        elif isinstance(value, LoDTensor):
            if value.recursive_sequence_lengths():
                raise FeedError(f"feed {name!r} is a LoDTensor with sequence lengths, but {name!r} was declared "
                                     "without them", hint=f"declare it with layers.data({name!r}, ..., lod_level=1)")
            out[name] = np.asarray(value)
        else:
            out[name] = value
    return out


class DataFeeder:
    """Fluid 1.5's ``DataFeeder(feed_list, place, program=None)``: ``feed(minibatch)`` turns a list of
    samples (one entry per variable of ``feed_list``) into an ``Executor.run`` feed. Entries of a
    ``lod_level=1`` variable are sequences and become a LoDTensor; others are stacked into a batch of the
    variable's shape."""

    def __init__(self, feed_list: Iterable[Variable | str], place: Any = None, program: Program | None = None) -> None:
        self.place = place
        self.program = program if program is not None else default_main_program()
        block = self.program.global_block()
        self.vars: list[Variable] = []
        for v in feed_list:
            name = v.name if isinstance(v, Variable) else v
            var = block.find_var_recursive(name) if isinstance(name, str) else None
            if var is None:
                raise FeedError(f"DataFeeder: {v!r} is not a variable of the program",
                                     hint="pass the variables layers.data returned")
            self.vars.append(var)
        self._lod = [is_lod_var(block, v.name) for v in self.vars]

    @property
    def feed_names(self) -> list[str]:
        return [v.name for v in self.vars]

    def feed(self, iterable: Iterable[Sequence[Any]]) -> dict[str, Any]:
        samples = [tuple(s) for s in iterable]
        for i, s in enumerate(samples):
            if len(s) != len(self.vars):
                raise FeedError(f"DataFeeder: sample {i} has {len(s)} fields, expected {len(self.vars)} "
                                     f"({self.feed_names})")
        result: dict[str, Any] = {}
        for j, (var, lod) in enumerate(zip(self.vars, self._lod)):
            column = [s[j] for s in samples]
            if lod:
                seqs = [np.asarray(c, dtype=var.dtype).reshape((-1,) + tuple(var.shape[1:])) for c in column]
                rows = np.concatenate(seqs) if seqs else np.zeros((0,) + tuple(var.shape[1:]), var.dtype)
                result[var.name] = LoDTensor(rows, [[len(q) for q in seqs]])
            else:
                try:
                    batch = np.asarray(column, dtype=var.dtype)
                except (TypeError, ValueError) as e:
                    raise FeedError(
                        f"DataFeeder: field {var.name!r} cannot be converted to {var.dtype}: {e}") from None
                shape = (len(samples),) + tuple(var.shape[1:]) if var.shape and var.shape[0] == -1 else var.shape
                result[var.name] = batch.reshape(shape)
        return result
