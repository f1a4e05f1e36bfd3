"""Build a small training program with the raw Block API, verify it, and print it (the README's first
quickstart command: ``python examples/build_program.py``).

The model is linear regression, one fc layer with a squared-error cost, written op by op as Fluid's
``layers`` and ``optimizer`` would emit it::

    forward   pred = x @ fc_w + fc_b;  cost = mean(square(pred - label))
    backward  cost@GRAD = 1 (fill_constant, role backward|loss), then the *_grad ops in reverse order
    optimize  sgd(param, param@GRAD, learning_rate) for fc_w and fc_b

Backward and optimize ops carry ``op_role_var = [param, grad]`` for the parameter they work on: the
transpiler finds parameters and gradients through it, never through names. The startup program
initialises the parameters and the learning rate.
"""
from __future__ import annotations

import sys

from ir import OpRole, Program, grad_name
from ir.verify import verify

IN_FEATURES = 13
OUT_FEATURES = 1
LEARNING_RATE = 0.01

FORWARD = int(OpRole.FORWARD)
BACKWARD = int(OpRole.BACKWARD)
LOSS_GRAD = int(OpRole.BACKWARD | OpRole.LOSS)
OPTIMIZE = int(OpRole.OPTIMIZE)


def build_programs() -> tuple[Program, Program]:
    """The (main, startup) programs of the fc + squared-error model trained with SGD."""
    main, startup = Program(), Program()
    block = main.global_block()

    # --- data and parameters
    block.create_var("x", shape=(-1, IN_FEATURES), is_data=True, stop_gradient=True)
    block.create_var("label", shape=(-1, OUT_FEATURES), is_data=True, stop_gradient=True)
    params = {
        "fc_w": block.create_parameter("fc_w", shape=(IN_FEATURES, OUT_FEATURES)),
        "fc_b": block.create_parameter("fc_b", shape=(OUT_FEATURES,)),
    }
    block.create_var("learning_rate_0", shape=(1,), persistable=True)

    # --- forward
    for name in ("fc_mul", "pred", "diff", "sq", "cost"):
        block.create_var(name)
    block.append_op("mul", {"X": "x", "Y": "fc_w"}, {"Out": "fc_mul"}, {"op_role": FORWARD})
    block.append_op("elementwise_add", {"X": "fc_mul", "Y": "fc_b"}, {"Out": "pred"}, {"op_role": FORWARD})
    block.append_op("elementwise_sub", {"X": "pred", "Y": "label"}, {"Out": "diff"}, {"op_role": FORWARD})
    block.append_op("square", {"X": "diff"}, {"Out": "sq"}, {"op_role": FORWARD})
    block.append_op("mean", {"X": "sq"}, {"Out": "cost"}, {"op_role": FORWARD})

    # --- backward: seed d(cost)/d(cost) = 1, then each forward op's gradient, last op first
    g = grad_name
    for name in ("cost", "sq", "diff", "pred", "fc_mul", "fc_w", "fc_b"):
        block.create_var(g(name))
    block.append_op("fill_constant", outputs={"Out": g("cost")},
                    attrs={"shape": [1], "value": 1.0, "dtype": "float32", "op_role": LOSS_GRAD})
    block.append_op("mean_grad", {"X": "sq", "Out@GRAD": g("cost")}, {"X@GRAD": g("sq")}, {"op_role": BACKWARD})
    block.append_op("square_grad", {"X": "diff", "Out@GRAD": g("sq")}, {"X@GRAD": g("diff")}, {"op_role": BACKWARD})
    # label needs no gradient (stop_gradient), so only X@GRAD is produced.
    block.append_op("elementwise_sub_grad", {"X": "pred", "Y": "label", "Out@GRAD": g("diff")},
                    {"X@GRAD": g("pred")}, {"op_role": BACKWARD})
    block.append_op("elementwise_add_grad", {"X": "fc_mul", "Y": "fc_b", "Out@GRAD": g("pred")},
                    {"X@GRAD": g("fc_mul"), "Y@GRAD": g("fc_b")},
                    {"op_role": BACKWARD, "op_role_var": ["fc_b", g("fc_b")]})
    # x is data, so mul_grad computes only the weight's gradient.
    block.append_op("mul_grad", {"X": "x", "Y": "fc_w", "Out@GRAD": g("fc_mul")}, {"Y@GRAD": g("fc_w")},
                    {"op_role": BACKWARD, "op_role_var": ["fc_w", g("fc_w")]})

    # --- optimize: one sgd op per parameter, updating it in place
    for name in params:
        block.append_op("sgd", {"Param": name, "Grad": g(name), "LearningRate": "learning_rate_0"},
                        {"ParamOut": name}, {"op_role": OPTIMIZE, "op_role_var": [name, g(name)]})

    # --- startup: initialise the parameters and the learning rate
    sblock = startup.global_block()
    for name, param in params.items():
        sblock.create_parameter(name, shape=param.shape)
    sblock.create_var("learning_rate_0", shape=(1,), persistable=True)
    sblock.append_op("uniform_random", outputs={"Out": "fc_w"},
                     attrs={"shape": list(params["fc_w"].shape), "min": -0.5, "max": 0.5, "seed": 1})
    sblock.append_op("fill_constant", outputs={"Out": "fc_b"}, attrs={"shape": [OUT_FEATURES], "value": 0.0})
    sblock.append_op("fill_constant", outputs={"Out": "learning_rate_0"},
                     attrs={"shape": [1], "value": LEARNING_RATE})
    return main, startup


def main() -> int:
    main_program, startup_program = build_programs()
    verify(main_program)
    verify(startup_program)
    sys.stdout.write("# main program\n")
    sys.stdout.write(main_program.to_string())
    sys.stdout.write("# startup program\n")
    sys.stdout.write(startup_program.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
