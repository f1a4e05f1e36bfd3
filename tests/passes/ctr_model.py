"""A CTR-like model for the distributed-table tests: 26-slot ids [N, 26] into one distributed
table, concatenated with 13 dense features, one fc, square error loss."""
from __future__ import annotations

from flotilla.fluid import layers, optimizer
from ir.core import Program, program_guard
from ir.names import unique_name
from flotilla.fluid.param_attr import ParamAttr
from transpiler import DistributeTranspiler, DistributeTranspilerConfig


def build_ctr(opt: str = "sgd", rows: int = 1001) -> tuple[Program, Program]:
    main, startup = Program(), Program()
    with unique_name.guard(), program_guard(main, startup):
        ids = layers.data(name="ids", shape=[26], dtype="int64")
        dense = layers.data(name="dense", shape=[13], dtype="float32")
        emb = layers.embedding(ids, size=[rows, 8], is_sparse=True, is_distributed=True,
                               param_attr=ParamAttr(name="table"))
        x = layers.concat([layers.reshape(emb, [-1, 26 * 8]), dense], axis=1)
        pred = layers.fc(x, 1, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b"))
        y = layers.data(name="y", shape=[1], dtype="float32")
        loss = layers.mean(layers.square_error_cost(input=pred, label=y))
        {"sgd": lambda: optimizer.SGD(learning_rate=0.1), "adam": lambda: optimizer.Adam(learning_rate=0.1),
         "adagrad": lambda: optimizer.Adagrad(learning_rate=0.1),
         "momentum": lambda: optimizer.Momentum(learning_rate=0.1, momentum=0.9)}[opt]().minimize(loss)
    return main, startup


def transpile_ctr(opt: str = "sgd", pservers: int = 2, trainers: int = 2, sync_mode: bool = True,
                  dc_asgd: bool = False, rows: int = 1001) -> DistributeTranspiler:
    eps = ",".join(f"127.0.0.1:{6174 + i}" for i in range(pservers))
    t = DistributeTranspiler(DistributeTranspilerConfig(enable_dc_asgd=dc_asgd))
    main, startup = build_ctr(opt, rows)
    t.transpile(0, program=main, pservers=eps, trainers=trainers, sync_mode=sync_mode, startup_program=startup)
    return t
