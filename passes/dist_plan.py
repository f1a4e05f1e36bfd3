"""The distribution plan the parameter-server passes share: which parameters are trained, how
each is sliced, and which pserver endpoint holds every slice.

The plan is built in stages by the passes (``collect_params`` → ``slice_variables`` →
``place_blocks``) and read by the rewriting passes; every value here is frozen, a stage replaces
the plan with an updated copy (``dataclasses.replace``).

Invariants (once placed):
- ``ParamPlan.param_blocks`` and ``ParamPlan.grad_blocks`` have the same length and the same row
  partition; ``endpoints`` has one entry per block, and block ``i`` of the parameter and of its
  gradient live on ``endpoints[i]``.
- Blocks tile their variable exactly: offsets start at 0, each block starts where the previous one
  ends, and the rows add up to dim 0 of the variable.
- A block's ``name`` is the name of the variable that holds it on the pserver: the variable itself
  when it has one block, else ``block_name(origin, index)``. The per-trainer gradient copies
  (sync mode, several trainers) are ``trainer_copy_name(block.name, trainer_id)``
  (see ``DistPlan.trainer_grad_name``).
- Geo-SGD (``geo_sgd_push_nums`` > 0, async): a dense parameter block's delta travels as
  ``VarBlock.delta_name``; gradient blocks are still planned (same partition) but never sent.
- Orders are deterministic: params in the order collected, endpoints in the user's order.
- Hybrid mode (``hybrid``): ``params`` is empty (the dense parameters stay on the trainers, averaged by
  allreduce, see ``passes.collective_plan``) and ``table`` is set: the pservers hold the table only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

from ir.errors import IRError
from ir.names import geo_delta_name, prefetch_in_name, prefetch_out_name, pserver_shard_name, trainer_copy_name


@dataclass(frozen=True)
class VarBlock:
    """One slice of a variable along dim 0: rows ``[offset_rows, offset_rows + rows)`` of ``origin``."""

    origin: str
    index: int
    offset_rows: int
    rows: int
    shape: tuple[int, ...]
    name: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def width(self) -> int:
        """Elements per row (the product of dims 1..)."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def offset(self) -> int:
        """The first element of the slice in the flattened origin variable (Fluid's ``offset``)."""
        return self.offset_rows * self.width

    @property
    def is_slice(self) -> bool:
        return self.name != self.origin

    @property
    def delta_name(self) -> str:
        """Geo-SGD: the name a trainer sends this parameter block's change since its last sync under
        (``<block>@DELTA``; the relation is recorded in the ``geo_sync`` op's attrs)."""
        return geo_delta_name(self.name)


@dataclass(frozen=True)
class ParamPlan:
    """One trainable parameter, its gradient, their slices and where the slices live."""

    param: str
    grad: str
    param_blocks: tuple[VarBlock, ...] = ()
    grad_blocks: tuple[VarBlock, ...] = ()
    endpoints: tuple[str, ...] = ()
    sparse: bool = False  # the gradient is selected_rows (a local sparse embedding)

    @property
    def is_sliced(self) -> bool:
        return len(self.param_blocks) > 1

    @property
    def sections(self) -> list[int]:
        """Rows of each block (the ``sections`` / ``height_sections`` of the split op)."""
        return [b.rows for b in self.grad_blocks]

    def blocks(self) -> Iterator[tuple[VarBlock, VarBlock, str]]:
        """(param block, grad block, endpoint) triples in block order."""
        return iter(zip(self.param_blocks, self.grad_blocks, self.endpoints))


@dataclass(frozen=True)
class TablePlan:
    """The distributed lookup table: sharded by ``id % len(endpoints)`` over every pserver."""

    table: str
    grad: str
    shape: tuple[int, ...]
    endpoints: tuple[str, ...]
    optimizer: str  # the type of the user's optimizer op on the table (applied sparsely)

    @property
    def shard_rows(self) -> int:
        """Rows each pserver declares for its shard: ``ceil(rows / num_pservers)``."""
        return -(-self.shape[0] // len(self.endpoints))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.shard_rows,) + tuple(self.shape[1:])

    def shard_grad_name(self, pserver_index: int, trainer_id: int | None = None) -> str:
        """``table@GRAD.pserver_<i>`` or, for a trainer's copy in sync mode, ``table@GRAD.trainer_<t>.pserver_<i>``."""
        base = self.grad if trainer_id is None else trainer_copy_name(self.grad, trainer_id)
        return pserver_shard_name(base, pserver_index)

    @property
    def delta_name(self) -> str:
        """Geo-SGD: the name a trainer sends the change of its touched table rows under (``table@DELTA``,
        selected rows with global row ids, one shard per pserver)."""
        return geo_delta_name(self.table)

    def prefetch_in_name(self, pserver_index: int) -> str:
        return prefetch_in_name(pserver_index)

    def prefetch_out_name(self, pserver_index: int) -> str:
        return prefetch_out_name(pserver_index)


@dataclass(frozen=True)
class DistPlan:
    """Everything the pserver-mode passes decide, shared through the PassContext."""

    trainer_id: int
    trainers: int
    sync_mode: bool
    pservers: tuple[str, ...]
    params: tuple[ParamPlan, ...] = ()
    table: TablePlan | None = None
    slice_var_up: bool = True
    min_block_size: int = 8192
    enable_dc_asgd: bool = False
    geo_sgd_push_nums: int = 0  # Geo-SGD: sync the dense parameters every k steps; 0: off
    hybrid: bool = False  # dense parameters stay on the trainers (allreduce); only the table is on the pservers
    placed: bool = False
    _by_param: dict[str, ParamPlan] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_param", {p.param: p for p in self.params})

    @property
    def geo_sgd(self) -> bool:
        """Geo-SGD: trainers optimize the dense parameters locally and sync their deltas every k steps."""
        return self.geo_sgd_push_nums > 0

    # --- naming
    @property
    def uses_trainer_copies(self) -> bool:
        """Sync mode with several trainers: each trainer sends its own copy of every gradient."""
        return self.sync_mode and self.trainers > 1

    def trainer_grad_name(self, block: VarBlock, trainer_id: int | None = None) -> str:
        """The name trainer ``trainer_id`` (default: this plan's trainer) sends ``block`` under."""
        if not self.uses_trainer_copies:
            return block.name
        return trainer_copy_name(block.name, self.trainer_id if trainer_id is None else trainer_id)

    # --- lookups
    def param_plan(self, param: str) -> ParamPlan:
        try:
            return self._by_param[param]
        except KeyError:
            raise IRError(f"the distribution plan has no parameter {param!r}",
                          hint=f"planned parameters: {list(self._by_param)}") from None

    def has_param(self, param: str) -> bool:
        return param in self._by_param

    def endpoint_index(self, endpoint: str) -> int:
        try:
            return self.pservers.index(endpoint)
        except ValueError:
            raise IRError(f"endpoint {endpoint!r} is not one of the pservers {list(self.pservers)}",
                          hint="pass one of the endpoints given to transpile(pservers=...)") from None

    def blocks_on(self, endpoint: str) -> list[tuple[ParamPlan, int]]:
        """(param plan, block index) of every slice held by ``endpoint``, in send order
        (parameters in plan order, blocks in index order)."""
        self.endpoint_index(endpoint)
        return [(p, i) for p in self.params for i, ep in enumerate(p.endpoints) if ep == endpoint]

    def bytes_on(self, endpoint: str, itemsize: int = 4) -> int:
        """Bytes of parameter slices held by ``endpoint`` (for ``flotilla plan``)."""
        return sum(p.param_blocks[i].numel * itemsize for p, i in self.blocks_on(endpoint))
