"""``fluid.incubate``: Paddle 1.5's module paths of the Fleet API, so a script's
``from paddle.fluid.incubate.fleet... import ...`` ports by rewriting ``paddle.fluid`` to ``flotilla.fluid``.

Re-exports only: every object is the one in ``flotilla.fleet``, its one home. This package is a bridge
(it brings the runtime and the transpiler), so ``import flotilla.fluid`` does not import it;
``fluid.incubate`` imports it on first use.
"""
