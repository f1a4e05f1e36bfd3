"""Variable naming helpers and the ``unique_name`` generator.

Names are produced only here. A name never carries meaning alone: whoever creates a derived variable
(a gradient, a slice, a per-trainer copy) also records the relation on the Variable
(``slice_of``/``slice_index``/``slice_offset``, ``copy_of``/``trainer_id``), and passes read that.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Iterator

GRAD_SUFFIX = "@GRAD"
EMPTY_VAR_NAME = "@EMPTY@"
LR_DECAY_COUNTER = "@LR_DECAY_COUNTER@"

# Well-known variables of transpiled programs (the runtime reads some of them by name).
SEND_BARRIER_OUT = "__control_var@send_barrier"  # control-dependency output of the trainer's send_barrier
FETCH_BARRIER_OUT = "__control_var@fetch_barrier"  # ... and of its fetch_barrier
TRAINER_ID_VAR = "@TRAINER_ID@"  # pserver: set by the runtime to the id of the trainer whose gradient is applied
GEO_STEP_VAR = "@GEO_SGD_STEP@"  # Geo-SGD: the trainer's step counter (persistable int64 [1])
LOCAL_SGD_STEP_VAR = "@LOCAL_SGD_STEP@"  # local SGD: the trainer's step counter
NCCL_ID_VAR = "NCCLID"  # collective: the communicator id c_gen_nccl_id writes


def grad_name(name: str) -> str:
    """``fc_w`` → ``fc_w@GRAD``."""
    return name + GRAD_SUFFIX


def block_name(name: str, index: int) -> str:
    """The name of slice ``index`` of a sliced variable: ``fc_w`` → ``fc_w.block1``."""
    return f"{name}.block{index}"


def trainer_copy_name(name: str, trainer_id: int) -> str:
    """The name of a trainer's copy of a gradient on a pserver: ``g.block0`` → ``g.block0.trainer_3``."""
    return f"{name}.trainer_{trainer_id}"


def recompute_name(name: str) -> str:
    """A forward value recomputed in the backward pass: ``fc_0.tmp_1`` → ``fc_0.tmp_1@RECOMPUTE``
    (recorded as ``copy_of``)."""
    return f"{name}@RECOMPUTE"


def dc_asgd_backup_name(param: str, trainer_id: int) -> str:
    """DC-ASGD: the pserver's copy of ``param`` as trainer ``trainer_id`` last fetched it:
    ``fc_w.block0`` → ``fc_w.block0.trainer_1_bak`` (recorded as ``copy_of``/``trainer_id``)."""
    return f"{param}.trainer_{trainer_id}_bak"


def seq_len_name(name: str) -> str:
    """The fed variable holding the sequence lengths of the lod_level=1 data variable ``name``:
    ``words`` → ``words@SEQ_LEN`` (int64 [N], one row count per sequence)."""
    return name + "@SEQ_LEN"


def send_dummy_name(grad: str) -> str:
    """The control-dependency output of the ``send`` of gradient ``grad``."""
    return f"__control_var@send@{grad}"


def pserver_shard_name(name: str, pserver_index: int) -> str:
    """The part of ``name`` (a distributed table's gradient) that goes to pserver ``pserver_index``:
    ``table@GRAD`` → ``table@GRAD.pserver_1``."""
    return f"{name}.pserver_{pserver_index}"


def prefetch_in_name(pserver_index: int) -> str:
    """The ids a trainer asks pserver ``pserver_index`` for the rows of (the distributed table's prefetch)."""
    return f"prefetch_compress_in_tmp_{pserver_index}"


def prefetch_out_name(pserver_index: int) -> str:
    """The rows pserver ``pserver_index`` answers a prefetch with."""
    return f"prefetch_compress_out_tmp_{pserver_index}"


def geo_delta_name(name: str) -> str:
    """Geo-SGD: the name a trainer sends the change of parameter block (or table) ``name`` since its last
    sync under (``name@DELTA``; the relation is recorded in the ``geo_sync`` op's attrs)."""
    return f"{name}@DELTA"


def geo_snapshot_name(param: str) -> str:
    """Geo-SGD: the trainer's copy of ``param`` at its last sync (``copy_of`` records the parameter)."""
    return f"{param}@GEO_SNAPSHOT"


def dc_asgd_local_name(param: str) -> str:
    """DC-ASGD: the optimize block's copy of the backup of ``param`` for the trainer being applied
    (``fc_w.block0`` → ``fc_w.block0.local_bak``)."""
    return f"{param}.local_bak"


def dc_asgd_temp_name(grad: str, step: int) -> str:
    """DC-ASGD: the ``step``-th intermediate of the compensated gradient ``grad``
    (``fc_w@GRAD.block0`` → ``fc_w@GRAD.block0.dc_asgd_0``)."""
    return f"{grad}.dc_asgd_{step}"


def geo_updates_name(table: str) -> str:
    """Geo-SGD: what a trainer fetches from a pserver to get the rows of its shard of distributed table
    ``table`` that changed since this trainer last fetched them (``table@GEO_UPDATES``, served as
    selected rows with global row ids; not a variable of any program)."""
    return f"{table}{GEO_UPDATES_SUFFIX}"


GEO_UPDATES_SUFFIX = "@GEO_UPDATES"


def is_geo_updates_name(name: str) -> bool:
    """Whether ``name`` is a ``geo_updates_name``: a reply of any size up to its table's shard."""
    return name.endswith(GEO_UPDATES_SUFFIX)


def geo_touched_name(table: str) -> str:
    """Geo-SGD: the trainer's mask of the rows of ``table`` it looked up since its last sync
    (``table@GEO_TOUCHED``, persistable bool ``[rows]``)."""
    return f"{table}@GEO_TOUCHED"


class UniqueNameGenerator:
    """Hands out ``prefix_N`` names, counting per prefix."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self._ids: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, key: str) -> str:
        with self._lock:
            n = self._ids[key]
            self._ids[key] = n + 1
        return f"{self.prefix}{key}_{n}"


class _UniqueName:
    def __init__(self) -> None:
        self.generator = UniqueNameGenerator()

    def generate(self, key: str) -> str:
        """A fresh name ``key_N``."""
        return self.generator(key)

    def __call__(self, key: str) -> str:
        return self.generate(key)

    def switch(self, new_generator: UniqueNameGenerator | None = None) -> UniqueNameGenerator:
        """Install ``new_generator`` (a fresh one by default); returns the previous one."""
        old = self.generator
        self.generator = new_generator if new_generator is not None else UniqueNameGenerator()
        return old

    @contextlib.contextmanager
    def guard(self, new_generator: UniqueNameGenerator | str | None = None) -> Iterator[None]:
        """Use a fresh generator (or one with a string prefix) inside the ``with`` block."""
        if isinstance(new_generator, str):
            new_generator = UniqueNameGenerator(new_generator)
        old = self.switch(new_generator)
        try:
            yield
        finally:
            self.switch(old)


unique_name = _UniqueName()
