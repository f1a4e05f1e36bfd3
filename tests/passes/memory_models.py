"""Models shared by the memory-rewrite tests: Paddle 1.5's test programs and small MLPs."""
from __future__ import annotations

from typing import Sequence

from flotilla.fluid import layers, optimizer
from ir.core import Program, Variable, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr


def mlp(hidden: Sequence[int] = (4, 4), in_dim: int = 8, opt: str = "sgd",
        act: str = "relu") -> tuple[Program, Program, Variable]:
    """x[in_dim] → fc(h, act) for h in ``hidden`` → fc(1) → square_error_cost → mean; parameters w<i>, b<i>
    (wo, bo for the output layer), seeded initialisers."""
    from flotilla.fluid.initializer import Uniform

    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        h = layers.data("x", [in_dim])
        for i, n in enumerate(hidden):
            h = layers.fc(h, n, act=act, param_attr=ParamAttr(name=f"w{i}", initializer=Uniform(-0.5, 0.5, seed=i + 1)),
                          bias_attr=ParamAttr(name=f"b{i}", initializer=Uniform(-0.1, 0.1, seed=i + 11)))
        pred = layers.fc(h, 1, param_attr=ParamAttr(name="wo", initializer=Uniform(-0.5, 0.5, seed=21)),
                         bias_attr=ParamAttr(name="bo"))
        y = layers.data("y", [1])
        loss = layers.mean(layers.square_error_cost(pred, y))
        {"sgd": lambda: optimizer.SGD(0.1), "adam": lambda: optimizer.Adam(0.01)}[opt]().minimize(loss)
    return main, startup, loss


def control_flow_graph_model() -> tuple[Program, Variable]:
    """Paddle 1.5 TestControlFlowGraph: x[13] → fc(1) → square_error_cost → mean, SGD 0.001."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data("x", [13])
        y_predict = layers.fc(x, 1)
        y = layers.data("y", [1])
        avg_cost = layers.mean(layers.square_error_cost(y_predict, y))
        optimizer.SGD(0.001).minimize(avg_cost)
    return main, avg_cost


def memory_transpiler2_model() -> tuple[Program, Variable, Variable]:
    """Paddle 1.5 TestMemoryTranspiler2: fc(10) → reshape [-1,2,5] → reshape [-1,5,2] → fc(1) →
    square_error_cost → mean, SGD 0.001; returns (main, cost, fc)."""
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        x = layers.data("x", [13])
        fc = layers.fc(x, 10)
        reshape = layers.reshape(fc, [-1, 2, 5])
        reshape = layers.reshape(reshape, [-1, 5, 2])
        y_predict = layers.fc(reshape, 1)
        y = layers.data("y", [1])
        cost = layers.square_error_cost(y_predict, y)
        avg_cost = layers.mean(cost)
        optimizer.SGD(0.001).minimize(avg_cost)
    return main, cost, fc


def used_names(program: Program) -> set[str]:
    """The distinct variable names the ops of ``program`` read or write."""
    return {n for b in program.blocks for op in b.ops for n in op.input_arg_names + op.output_arg_names}
