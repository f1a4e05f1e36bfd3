"""``DistributeTranspilerConfig`` and the validation of ``transpile``'s inputs.

Every invalid input raises ``TranspilerError`` with a stable code and a hint:
E701 endpoints (empty, duplicated, malformed), E702 trainers, E703 trainer_id, E705 min_block_size,
E706 an endpoint not in the pserver list, E709 enable_dc_asgd with sync_mode, E710 split_method,
E711 mode, E712 a program argument that is not a Program. The passes add E601 (no optimizer ops),
E602 (several distributed tables), E603/E604 (an optimizer the pserver cannot run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ir.errors import FlotillaError

from transpiler.ps_dispatcher import PSDispatcher, RoundRobin


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

    def validated(self) -> "DistributeTranspilerConfig":
        """A checked copy with ``split_method`` defaulted to RoundRobin."""
        split = self.split_method if self.split_method is not None else RoundRobin
        if not (isinstance(split, type) and issubclass(split, PSDispatcher)):
            raise TranspilerError(f"split_method must be a PSDispatcher subclass, got {split!r}",
                                  hint="use RoundRobin, HashName or your own PSDispatcher subclass", code="E710")
        mbs = self.min_block_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise TranspilerError(f"min_block_size must be an int >= 1, got {mbs!r}",
                                  hint="the default is 8192 elements", code="E705")
        if self.mode != "pserver":
            raise TranspilerError(f"mode {self.mode!r} is not supported by this transpiler; expected 'pserver'",
                                  hint="nccl2/collective modes are a separate transpile path", code="E711")
        return DistributeTranspilerConfig(bool(self.slice_var_up), split, mbs, self.mode, bool(self.enable_dc_asgd),
                                          bool(self.print_log), bool(self.wait_port))


def parse_endpoints(pservers: Any) -> tuple[str, ...]:
    """``"h:p,h:p"`` (or a list) → endpoints, each ``host:port`` with 1 <= port <= 65535, no duplicates."""
    if isinstance(pservers, (list, tuple)):
        items = list(pservers)
    elif isinstance(pservers, str):
        items = pservers.split(",")
    else:
        raise TranspilerError(f"pservers must be a comma-separated string of host:port, got {pservers!r}",
                              hint='e.g. "127.0.0.1:6174,127.0.0.1:6175"', code="E701")
    eps = [e.strip() if isinstance(e, str) else e for e in items]
    if not eps or eps == [""]:
        raise TranspilerError("pservers is empty; expected at least one host:port endpoint",
                              hint='e.g. "127.0.0.1:6174"', code="E701")
    for ep in eps:
        check_endpoint(ep)
    dups = sorted({e for e in eps if eps.count(e) > 1})
    if dups:
        raise TranspilerError(f"pservers lists {dups} more than once; expected distinct endpoints",
                              hint="give each pserver once", code="E701")
    return tuple(eps)


def check_endpoint(ep: Any) -> str:
    if not isinstance(ep, str) or ":" not in ep:
        raise TranspilerError(f"endpoint {ep!r} is malformed; expected host:port", hint='e.g. "127.0.0.1:6174"',
                              code="E701")
    host, _, port = ep.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise TranspilerError(f"endpoint {ep!r} is malformed; expected host:port with a port in 1..65535",
                              hint='e.g. "127.0.0.1:6174"', code="E701")
    return ep


def check_trainers(trainers: Any, trainer_id: Any) -> tuple[int, int]:
    if isinstance(trainers, bool) or not isinstance(trainers, int) or trainers < 1:
        raise TranspilerError(f"trainers must be an int >= 1 in pserver mode, got {trainers!r}",
                              hint="pass the number of trainer processes", code="E702")
    if isinstance(trainer_id, bool) or not isinstance(trainer_id, int) or not 0 <= trainer_id < trainers:
        raise TranspilerError(f"trainer_id {trainer_id!r} is out of range; expected an int in 0..{trainers - 1}",
                              hint="trainer ids count from 0 to trainers-1", code="E703")
    return trainers, trainer_id
