"""Pass ``place_blocks``: assign every slice to a pserver endpoint with the dispatcher.

As Fluid: reset the dispatcher and dispatch the gradient blocks once per gradient in plan order (the
counter carries over). Parameter blocks follow their gradient blocks: Fluid re-dispatched them after a
reset, which gives the same endpoints for RoundRobin but not for a name hash (``fc_b`` and
``fc_b@GRAD`` hash apart), so the endpoints are taken from the gradients directly. The dispatcher is ``ctx.dispatcher`` (any object
with ``reset()`` and ``dispatch(blocks) -> endpoints``).

Guarantees: every ParamPlan has one endpoint per block, each one of ``plan.pservers``; the plan is
marked ``placed``. Raises ``PassError`` (E620) when a dispatcher returns a wrong count or an unknown
endpoint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ir.program_set import ProgramSet

from passes.pass_base import Pass, PassContext, PassError


@dataclass(frozen=True)
class PlaceBlocks(Pass):
    """Needs: sliced params and ``ctx.dispatcher``. Guarantees: see the module docstring."""

    name = "place_blocks"

    def run(self, programs: ProgramSet, ctx: PassContext) -> bool:
        plan = ctx.plan
        d = ctx.dispatcher
        if d is None:
            raise PassError("place_blocks needs a dispatcher in the pass context", hint="set ctx.dispatcher",
                            code="E620")
        d.reset()
        grad_eps = [self._checked(d.dispatch(list(pp.grad_blocks)), len(pp.grad_blocks), plan.pservers, pp.grad)
                    for pp in plan.params]
        params = [dataclasses.replace(pp, endpoints=tuple(geps)) for pp, geps in zip(plan.params, grad_eps)]
        d.reset()
        ctx.plan = dataclasses.replace(plan, params=tuple(params), placed=True)
        return True

    @staticmethod
    def _checked(eps: object, count: int, pservers: tuple[str, ...], what: str) -> list[str]:
        if not isinstance(eps, (list, tuple)) or len(eps) != count:
            raise PassError(f"the dispatcher returned {eps!r} for {count} blocks of {what}; expected {count} endpoints",
                            hint="dispatch must return one endpoint per item", code="E620")
        for ep in eps:
            if ep not in pservers:
                raise PassError(f"the dispatcher returned endpoint {ep!r}, which is not a pserver {list(pservers)}",
                                hint="dispatch must pick from its eps", code="E620")
        return list(eps)
