"""``DistributeTranspilerConfig`` and the validation of ``transpile``'s inputs.

Every invalid input raises ``TranspilerError`` with a stable code and a hint:
E701 endpoints (empty, duplicated, malformed), E702 trainers, E703 trainer_id, E705 min_block_size,
E706 an endpoint not in the pserver list, E709 enable_dc_asgd with sync_mode, E718 split_method or config,
E711 mode (and the collective options), E712 a program argument that is not a Program, E714 a pserver
program asked for in a collective mode, E715 a field the config does not have (set by mistake, e.g.
``config.slice_var_upp = True``: it names the closest field), E717 the Geo-SGD options (``geo_sgd_mode``
outside pserver mode, with ``sync_mode`` or with ``enable_dc_asgd``; ``geo_sgd_need_push_nums`` < 1), E721
the sync/async fields (``sync_mode``, ``runtime_split_send_recv``, ``half_async``, ``completely_not_async``)
and ``hierarchical_allreduce_inter_nranks``. The passes add E601 (no optimizer ops), E602 (several distributed
tables), E603/E604 (an optimizer the pserver cannot run), E620-E623 (collective rewrites).

Every field of Fluid 1.5's and 1.6's config exists, so a ported script's assignments keep their meaning:
``sync_mode`` (None: ``transpile``'s ``sync_mode`` argument decides; True/False: the config wins, as a
Fluid 1.6 script that only sets ``config.sync_mode = False`` expects), ``completely_not_async`` (Fluid's
synchronous pserver under runtime splitting: here plain sync training), ``runtime_split_send_recv``
(Fluid split and merged sliced variables inside its send/recv ops instead of split/concat ops; Flotilla's
trainer program always uses ops, so the values sent and received, hence the training, are the same and
the flag changes nothing), ``hierarchical_allreduce_inter_nranks`` (only read with
``use_hierarchical_allreduce``, which is refused: XLA picks the algorithm). ``half_async`` (async updates
plus a trainer barrier every step) has no equivalent and is refused with what to use instead.

Geo-SGD (Paddle 1.6's ``geo_sgd_mode``, async pserver mode only): every trainer trains its own copy of the
parameters (a distributed lookup table included: the trainer then holds the whole table) and, every
``geo_sgd_need_push_nums`` steps, sends each parameter block's change since its last sync, and the change
of the table rows it looked up, to the pservers, which add them; it then continues from the merged
blocks and every table row any trainer changed since its last sync.

Modes: ``pserver`` (the default), ``nccl2`` and ``collective`` (the same allreduce rewrite under Fluid
1.5's and Fluid 1.6's names; ``collective_mode`` picks ``grad_allreduce`` or ``local_sgd``), and ``hybrid``:
dense parameters data-parallel across the trainers by allreduce (the nccl2 rewrite), the distributed lookup
table on the pservers (prefetch and sparse update, sync or async), in one trainer program. ``transpile``
then takes both ``pservers`` and ``trainers`` as endpoint lists. E722: an option hybrid mode cannot honour
(``enable_dc_asgd``: no dense gradient reaches a pserver to compensate).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ir import endpoints
from ir.errors import FlotillaError
from ir.ops.registry import suggest

from transpiler.ps_dispatcher import PSDispatcher, RoundRobin


MODES = ("pserver", "nccl2", "collective", "hybrid")
HYBRID = "hybrid"
COLLECTIVE_MODES = ("nccl2", "collective")
COLLECTIVE_KINDS = ("grad_allreduce", "local_sgd")


class TranspilerError(FlotillaError):
    """An invalid argument of the transpiler."""

    code = "E700"


@dataclass
class DistributeTranspilerConfig:
    """Paddle's config fields and defaults. ``split_method`` is a PSDispatcher subclass."""

    slice_var_up: bool = True
    split_method: type[PSDispatcher] | None = None
    min_block_size: int = 8192
    mode: str = "pserver"
    enable_dc_asgd: bool = False
    print_log: bool = False
    wait_port: bool = True
    # Collective modes (nccl2 / collective).
    collective_mode: str | None = None  # "grad_allreduce" (default) | "local_sgd"
    nccl_comm_num: int = 1
    fuse_grad_size_in_MB: float = 32.0  # gradient buckets for one allreduce each; 0 = one allreduce a gradient
    local_sgd_steps: int = 1  # local_sgd: average the parameters every k steps
    use_hierarchical_allreduce: bool = False
    hierarchical_allreduce_inter_nranks: int = 0
    # Geo-SGD (pserver mode, sync_mode=False): sync the parameters (and table rows) every k steps as deltas.
    geo_sgd_mode: bool = False
    geo_sgd_need_push_nums: int = 100  # k: local steps between two syncs
    # Sync/async (pserver mode): see the module docstring.
    sync_mode: bool | None = None  # None: transpile's sync_mode argument decides
    runtime_split_send_recv: bool = False
    half_async: bool = False
    completely_not_async: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        # Fluid scripts set the config field by field; a misspelt field must not be silently ignored.
        fields = type(self).__dataclass_fields__
        if name not in fields:
            raise TranspilerError(f"DistributeTranspilerConfig has no field {name!r}",
                                  hint=suggest(name, fields) or f"the fields are {', '.join(fields)}", code="E715")
        object.__setattr__(self, name, value)

    @property
    def is_collective(self) -> bool:
        """Allreduce among the trainers and no parameter server (nccl2/collective)."""
        return self.mode in COLLECTIVE_MODES

    @property
    def is_hybrid(self) -> bool:
        """Dense parameters allreduced among the trainers, the distributed table on the pservers."""
        return self.mode == HYBRID

    def effective_sync_mode(self, argument: Any) -> bool:
        """Sync or async for ``transpile(sync_mode=argument)``: the config's own choice wins when it makes one."""
        if self.completely_not_async:
            if self.sync_mode is False:
                raise TranspilerError("completely_not_async (synchronous training) and sync_mode=False are both "
                                      "set", hint="unset one of them: completely_not_async means sync_mode=True",
                                      code="E721")
            return True
        return bool(argument if self.sync_mode is None else self.sync_mode)

    def validated(self) -> "DistributeTranspilerConfig":
        """A checked copy with ``split_method`` defaulted to RoundRobin."""
        split = self.split_method if self.split_method is not None else RoundRobin
        if not (isinstance(split, type) and issubclass(split, PSDispatcher)):
            raise TranspilerError(f"split_method must be a PSDispatcher subclass, got {split!r}",
                                  hint="use RoundRobin, HashName or your own PSDispatcher subclass", code="E718")
        mbs = self.min_block_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise TranspilerError(f"min_block_size must be an int >= 1, got {mbs!r}",
                                  hint="the default is 8192 elements", code="E705")
        if self.mode not in MODES:
            raise TranspilerError(f"mode {self.mode!r} is not a transpiler mode; expected one of {list(MODES)}",
                                  hint="'pserver' for parameter servers, 'nccl2' or 'collective' for allreduce, "
                                       "'hybrid' for allreduce of dense parameters beside a distributed table on "
                                       "the pservers",
                                  code="E711")
        coll = self.collective_mode
        if coll is None:
            coll = "grad_allreduce"
        if coll not in COLLECTIVE_KINDS:
            raise TranspilerError(f"collective_mode {coll!r} is not supported; expected one of {list(COLLECTIVE_KINDS)}",
                                  hint="grad_allreduce averages gradients every step; local_sgd averages parameters "
                                       "every local_sgd_steps steps", code="E711")
        if coll != "grad_allreduce" and self.mode not in COLLECTIVE_MODES:
            raise TranspilerError(f"collective_mode {coll!r} needs mode 'nccl2' or 'collective', but mode is "
                                  f"{self.mode!r}", hint="set config.mode = 'collective'"
                                  + (" (hybrid mode averages dense gradients every step)" if self.mode == HYBRID
                                     else ""), code="E711")
        if self.mode == HYBRID and self.enable_dc_asgd:
            raise TranspilerError("enable_dc_asgd is set in hybrid mode, where no dense gradient reaches a pserver "
                                  "(DC-ASGD compensates dense gradients there) and the table's sparse gradient "
                                  "cannot be compensated", hint="disable enable_dc_asgd, or use mode 'pserver'",
                                  code="E722")
        _check_int("nccl_comm_num", self.nccl_comm_num, 1, "the number of communicators (rings)")
        _check_int("local_sgd_steps", self.local_sgd_steps, 1, "the number of local steps between averagings")
        fuse = self.fuse_grad_size_in_MB
        if isinstance(fuse, bool) or not isinstance(fuse, (int, float)) or not 0 <= fuse < float("inf"):
            raise TranspilerError(f"fuse_grad_size_in_MB must be a number >= 0, got {fuse!r}",
                                  hint="0 allreduces every gradient on its own; 32 is the default", code="E711")
        if self.use_hierarchical_allreduce:
            raise TranspilerError("use_hierarchical_allreduce is not supported: XLA chooses the collective "
                                  "algorithm itself", hint="leave use_hierarchical_allreduce False", code="E711")
        inter = self.hierarchical_allreduce_inter_nranks
        if isinstance(inter, bool) or not isinstance(inter, int) or inter < 0:
            raise TranspilerError(f"hierarchical_allreduce_inter_nranks must be an int >= 0, got {inter!r}",
                                  hint="it is read only with use_hierarchical_allreduce; leave it 0", code="E721")
        if self.sync_mode is not None and not isinstance(self.sync_mode, bool):
            raise TranspilerError(f"sync_mode must be True, False or None, got {self.sync_mode!r}",
                                  hint="None lets transpile's sync_mode argument decide", code="E721")
        if self.half_async:
            raise TranspilerError("half_async is not supported: Flotilla has no async mode with a trainer barrier "
                                  "every step", hint="use sync_mode=True (updates in lockstep) or sync_mode=False "
                                                     "(each gradient applied on arrival)", code="E721")
        push = self.geo_sgd_need_push_nums
        if isinstance(push, bool) or not isinstance(push, int) or push < 1:
            raise TranspilerError(f"geo_sgd_need_push_nums must be an int >= 1 (the local steps between two "
                                  f"syncs), got {push!r}", hint="the default is 100; 1 syncs after every step",
                                  code="E717")
        if self.geo_sgd_mode:
            if self.mode != "pserver":
                raise TranspilerError(f"geo_sgd_mode needs mode 'pserver', but mode is {self.mode!r}",
                                      hint="set config.mode = 'pserver', or use collective_mode 'local_sgd' to "
                                           "average parameters every k steps with allreduce", code="E717")
            if self.enable_dc_asgd:
                raise TranspilerError("geo_sgd_mode and enable_dc_asgd are both set; they are different async "
                                      "algorithms", hint="disable one of them (geo_sgd_mode sends parameter deltas, "
                                                         "DC-ASGD compensates stale gradients)", code="E717")
        return DistributeTranspilerConfig(
            slice_var_up=bool(self.slice_var_up), split_method=split, min_block_size=mbs, mode=self.mode,
            enable_dc_asgd=bool(self.enable_dc_asgd), print_log=bool(self.print_log), wait_port=bool(self.wait_port),
            collective_mode=coll, nccl_comm_num=int(self.nccl_comm_num), fuse_grad_size_in_MB=float(fuse),
            local_sgd_steps=int(self.local_sgd_steps), use_hierarchical_allreduce=False,
            hierarchical_allreduce_inter_nranks=inter, geo_sgd_mode=bool(self.geo_sgd_mode),
            geo_sgd_need_push_nums=int(push), sync_mode=self.sync_mode,
            runtime_split_send_recv=bool(self.runtime_split_send_recv), half_async=False,
            completely_not_async=bool(self.completely_not_async))


def _check_int(field: str, value: Any, minimum: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TranspilerError(f"{field} must be an int >= {minimum} ({what}), got {value!r}", code="E711")


def parse_endpoints(pservers: Any, what: str = "pservers") -> tuple[str, ...]:
    """``"h:p,h:p"`` (or a list) → canonical endpoints (``ir.endpoints`` parses); ``what`` names the argument."""
    try:
        return endpoints.parse_endpoint_list(pservers, what)
    except endpoints.EndpointSyntaxError as err:
        raise TranspilerError(err.message, hint=err.hint, code="E701") from None


def check_endpoint(ep: Any, what: str = "current_endpoint") -> str:
    """``ep`` in canonical ``host:port`` form."""
    try:
        return endpoints.canonical_endpoint(ep, what)
    except endpoints.EndpointSyntaxError as err:
        raise TranspilerError(err.message, hint=err.hint, code="E701") from None


def check_trainers(trainers: Any, trainer_id: Any) -> tuple[int, int]:
    if isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1:
        raise TranspilerError(f"trainers must be an int >= 1 in pserver mode, got {trainers!r}",
                              hint="pass the number of trainer processes", code="E702")
    if isinstance(trainer_id, bool) or not isinstance(trainer_id, int) or not 0 <= trainer_id < trainers:
        raise TranspilerError(f"trainer_id {trainer_id!r} is out of range; expected an int in 0..{trainers - 1}",
                              hint="trainer ids count from 0 to trainers-1", code="E703")
    return trainers, trainer_id
