"""The pass infrastructure: ``Pass``, ``PassContext``, ``PassManager`` and its instruments.

A pass is a frozen dataclass with typed options, a ``name`` and ``run(programs, ctx) -> bool``
(True when it changed a program or the shared plan). Passes work on a ``ProgramSet`` (role → main
and startup programs) and share decisions through the ``PassContext`` (the ``DistPlan``, the
caller's programs, warnings).

Invariants:
- The ``PassManager`` verifies every program of its input before the first pass and re-verifies
  after every pass that reports a change; a verifier failure raises ``PassError`` naming the pass
  that broke the IR and the passes that ran before it.
- Instruments observe, never change: they see each pass before and after it runs.
- Nothing here reads the environment; the façade reads ``FLOTILLA_PRINT_IR_AFTER`` once and passes
  a ``PrintIRAfter`` instrument in.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence, TextIO

from ir.core import Program
from ir.errors import FlotillaError, VerifyError
from ir.program_set import ProgramSet
from ir.verify import VerifyCache, format_context

from passes.collective_plan import CollectivePlan
from passes.dist_plan import DistPlan


class PassError(FlotillaError):
    """A pass could not apply, or the IR failed verification after a pass."""

    code = "E600"


@dataclass
class PassContext:
    """What passes share besides the programs: the plan they build, the caller's (cloned) input
    programs, and the warnings they raise for the user."""

    origin_main: Program
    origin_startup: Program
    plan: DistPlan
    dispatcher: Any = None  # a transpiler.ps_dispatcher.PSDispatcher (passes/ does not import it)
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    collective: CollectivePlan | None = None  # set in the collective (nccl2) modes
    # What the verifier found in each program, kept while the program is unchanged (its version).
    verify_cache: VerifyCache = field(default_factory=VerifyCache)

    def require_collective(self, pass_name: str) -> CollectivePlan:
        if self.collective is None:
            raise PassError(f"pass {pass_name!r} needs a collective plan, but the context has none",
                            hint="run it through DistributeTranspiler with config.mode = 'nccl2' or 'collective'")
        return self.collective

    def require_placed(self, pass_name: str) -> DistPlan:
        if not self.plan.placed:
            raise PassError(f"pass {pass_name!r} needs a placed distribution plan, but no slice has an endpoint yet",
                            hint="run collect_params, slice_variables and place_blocks before it")
        return self.plan


@dataclass(frozen=True)
class Pass:
    """Base of every pass. Subclasses are frozen dataclasses whose fields are the pass options."""

    name: ClassVar[str] = "pass"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        raise NotImplementedError(f"pass {self.name!r} does not implement run()")


class Instrument:
    """Observes a pipeline: called before and after each pass."""

    def before(self, p: Pass, programs: ProgramSet, ctx: PassContext) -> None:
        return None

    def after(self, p: Pass, programs: ProgramSet, ctx: PassContext, changed: bool) -> None:
        return None


class Timing(Instrument):
    """Records the wall time of each pass in ``ctx.timings`` (seconds, summed over runs)."""

    def __init__(self) -> None:
        self._start = 0.0

    def before(self, p: Pass, programs: ProgramSet, ctx: PassContext) -> None:
        self._start = time.perf_counter()

    def after(self, p: Pass, programs: ProgramSet, ctx: PassContext, changed: bool) -> None:
        ctx.timings[p.name] = ctx.timings.get(p.name, 0.0) + time.perf_counter() - self._start


class PrintIRAfter(Instrument):
    """Prints the whole ProgramSet after the passes named in ``which`` (``"all"`` for every pass)."""

    def __init__(self, which: str, stream: TextIO | None = None) -> None:
        self.which = {w.strip() for w in which.split(",") if w.strip()}
        self.stream = stream

    def after(self, p: Pass, programs: ProgramSet, ctx: PassContext, changed: bool) -> None:
        if "all" in self.which or p.name in self.which:
            out = self.stream if self.stream is not None else sys.stderr
            out.write(f"// ----- IR after pass {p.name} -----\n{programs.to_string()}")


class DumpToDir(Instrument):
    """Writes the ProgramSet after each pass to ``<dir>/<NN>_<pass>.txt``."""

    def __init__(self, directory: str | pathlib.Path) -> None:
        self.directory = pathlib.Path(directory)
        self._count = 0

    def after(self, p: Pass, programs: ProgramSet, ctx: PassContext, changed: bool) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", p.name)
        (self.directory / f"{self._count:02d}_{safe}.txt").write_text(programs.to_string())
        self._count += 1


def verify_programs(programs: ProgramSet, cache: VerifyCache | None = None) -> None:
    """Verify each program of the set on its own (the cross-program checks need a finished set);
    ``cache`` skips the programs no pass changed since it last verified them."""
    cache = cache if cache is not None else VerifyCache()
    located = []
    for role, progs in programs.items():
        for prefix, program in ((role, progs.main), (f"{role}/startup", progs.startup)):
            located += [(program, prefix, pr) for pr in cache.problems(program, role=prefix)]
    if located:
        first = next((item for item in located if item[2].op is not None), located[0])
        context = format_context(first[0], first[2], role=first[1]) if first[2].block is not None else None
        raise VerifyError([pr for _, _, pr in located], context=context or None)


class PassManager:
    """Runs a pipeline of passes, verifying around them and calling the instruments."""

    def __init__(self, passes: Sequence[Pass], instruments: Sequence[Instrument] = ()) -> None:
        for p in passes:
            if not isinstance(p, Pass):
                raise PassError(f"the pipeline holds {type(p).__name__} {p!r}, which is not a Pass",
                                hint="subclass passes.pass_base.Pass")
        self.passes = tuple(passes)
        self.instruments = tuple(instruments)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        """Run every pass in order; True when any of them changed something."""
        try:
            verify_programs(programs, ctx.verify_cache)
        except VerifyError as e:
            raise PassError(f"the input of the pipeline does not verify:\n{e.message}",
                            hint="fix the input program before transpiling") from e
        any_changed = False
        for i, p in enumerate(self.passes):
            for inst in self.instruments:
                inst.before(p, programs, ctx)
            changed = bool(p.run(programs, ctx))
            for inst in self.instruments:
                inst.after(p, programs, ctx, changed)
            if changed:
                any_changed = True
                try:
                    verify_programs(programs, ctx.verify_cache)
                except VerifyError as e:
                    before = [q.name for q in self.passes[:i]]
                    raise PassError(
                        f"the IR does not verify after pass {p.name!r} (passes before it: {before or 'none'}):\n"
                        f"{e.message}",
                        hint=f"pass {p.name!r} broke the IR; run with FLOTILLA_PRINT_IR_AFTER={p.name} to see it",
                    ) from e
        return any_changed


def options_of(p: Pass) -> dict[str, Any]:
    """The options (dataclass fields) of a pass, for printing pipelines."""
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
