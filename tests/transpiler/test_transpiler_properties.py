"""Property tests of the parameter-server transpiler over random MLP and embedding programs.

Programs: MLPs of random depth and widths (random activations), or an embedding (dense or sparse
gradient) feeding an MLP; a random optimizer (SGD, Momentum, Adagrad, Adam, RMSProp, DecayedAdagrad,
Ftrl), sometimes with L2 weight decay or an exponential learning-rate decay. Cluster: 1–8 pservers,
1–16 trainers, sync or async, RoundRobin or HashName, a random ``min_block_size`` (small ones make
small parameters slice).

Properties: the whole ProgramSet verifies; the slices of each parameter tile it exactly once, one
optimizer op per slice, with Fluid's block count; transpiling twice gives byte-identical programs (text
and protobuf); the caller's programs are unchanged; ``get_*`` results do not depend on call order; and
HashName placement is the same in processes with different ``PYTHONHASHSEED``.

Bounded: 30 examples per property, small programs, so the module runs in seconds.
"""
from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ir
from flotilla.fluid import layers, learning_rate, optimizer, regularizer
from ir.core import Parameter, Program
from ir.program_set import ProgramSet
from ir.serialize import program_to_bytes
from ir.verify import cross_program_problems, verify_program_set
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, HashName, RoundRobin

pytestmark = pytest.mark.filterwarnings("ignore:pserver .* holds no parameter block")

PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPO = pathlib.Path(__file__).resolve().parents[2]

OPTIMIZERS: dict[str, Callable[[Any, Any], optimizer.Optimizer]] = {
    "sgd": lambda lr, reg: optimizer.SGD(lr, regularization=reg),
    "momentum": lambda lr, reg: optimizer.Momentum(lr, 0.9, regularization=reg),
    "adagrad": lambda lr, reg: optimizer.Adagrad(lr, regularization=reg),
    "adam": lambda lr, reg: optimizer.Adam(lr, regularization=reg),
    "rmsprop": lambda lr, reg: optimizer.RMSProp(lr, regularization=reg),
    "decayed_adagrad": lambda lr, reg: optimizer.DecayedAdagrad(lr, regularization=reg),
    "ftrl": lambda lr, reg: optimizer.Ftrl(lr, regularization=reg),
}


@dataclass(frozen=True)
class Model:
    """What to build: an MLP (``vocab == 0``) or an embedding [vocab, emb_dim] feeding one."""

    in_dim: int
    widths: tuple[int, ...]
    acts: tuple[str | None, ...]
    out_dim: int
    vocab: int
    emb_dim: int
    sparse: bool
    opt: str
    l2: bool
    lr_decay: bool

    def build(self) -> tuple[Program, Program]:
        main, startup = Program(), Program()
        with ir.unique_name.guard(), ir.program_guard(main, startup):
            if self.vocab:
                ids = layers.data("ids", [1], dtype="int64")
                h = layers.embedding(ids, [self.vocab, self.emb_dim], is_sparse=self.sparse)
            else:
                h = layers.data("x", [self.in_dim])
            for width, act in zip(self.widths, self.acts):
                h = layers.fc(h, width, act=act)
            y = layers.data("y", [self.out_dim])
            loss = layers.mean(layers.square_error_cost(layers.fc(h, self.out_dim), y))
            lr: Any = learning_rate.exponential_decay(0.1, 10, 0.5) if self.lr_decay else 0.1
            # An optimizer-wide regularizer cannot apply to a sparse gradient (it would make it dense).
            reg = regularizer.L2Decay(1e-4) if self.l2 and not (self.vocab and self.sparse) else None
            OPTIMIZERS[self.opt](lr, reg).minimize(loss)
        return main, startup


@dataclass(frozen=True)
class Cluster:
    pservers: tuple[str, ...]
    trainers: int
    trainer_id: int
    sync: bool
    hash_name: bool
    min_block_size: int
    slice_var_up: bool

    def config(self) -> DistributeTranspilerConfig:
        return DistributeTranspilerConfig(slice_var_up=self.slice_var_up,
                                          split_method=HashName if self.hash_name else RoundRobin,
                                          min_block_size=self.min_block_size)


@st.composite
def models(draw: st.DrawFn) -> Model:
    depth = draw(st.integers(0, 3))
    embedding = draw(st.booleans())
    return Model(
        in_dim=draw(st.integers(1, 300)),
        widths=tuple(draw(st.lists(st.integers(1, 300), min_size=depth, max_size=depth))),
        acts=tuple(draw(st.lists(st.sampled_from([None, "relu", "tanh", "sigmoid"]), min_size=depth,
                                 max_size=depth))),
        out_dim=draw(st.integers(1, 16)),
        vocab=draw(st.integers(2, 2000)) if embedding else 0,
        emb_dim=draw(st.integers(1, 32)),
        sparse=draw(st.booleans()),
        opt=draw(st.sampled_from(sorted(OPTIMIZERS))),
        l2=draw(st.booleans()),
        lr_decay=draw(st.booleans()),
    )


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    n = draw(st.integers(1, 8))
    ports = draw(st.lists(st.integers(1024, 65535), min_size=n, max_size=n, unique=True))
    trainers = draw(st.integers(1, 16))
    return Cluster(
        pservers=tuple(f"127.0.0.1:{p}" for p in ports),
        trainers=trainers,
        trainer_id=draw(st.integers(0, trainers - 1)),
        sync=draw(st.booleans()),
        hash_name=draw(st.booleans()),
        min_block_size=draw(st.sampled_from([1, 100, 1000, 8192])),
        slice_var_up=draw(st.integers(0, 4)) > 0,
    )


def transpile(main: Program, startup: Program, c: Cluster) -> DistributeTranspiler:
    t = DistributeTranspiler(c.config())
    t.transpile(c.trainer_id, program=main, pservers=",".join(c.pservers), trainers=c.trainers, sync_mode=c.sync,
                startup_program=startup)
    return t


def set_bytes(programs: ProgramSet) -> list[tuple[str, bytes, bytes]]:
    return [(role, program_to_bytes(p.main), program_to_bytes(p.startup)) for role, p in programs.items()]


def expected_blocks(shape: tuple[int, ...], slices: int, min_block_size: int) -> int:
    """Fluid's block count for a variable (written out independently of the pass)."""
    numel = math.prod(shape)
    split = min(slices, max(1, numel // min_block_size))
    block = math.ceil(numel / split)
    width = math.prod(shape[1:]) if len(shape) > 1 else 1
    block = math.ceil(block / width) * width
    return math.ceil(numel / block)


# --- properties ----------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(models(), clusters())
def test_program_set_verifies(model: Model, cluster: Cluster) -> None:
    main, startup = model.build()
    programs = transpile(main, startup, cluster).program_set
    assert programs.roles == [f"trainer.{cluster.trainer_id}"] + [f"pserver@{ep}" for ep in cluster.pservers]
    assert cross_program_problems(programs) == []
    verify_program_set(programs)


@PROPERTY_SETTINGS
@given(models(), clusters())
def test_slices_tile_each_parameter_exactly_once(model: Model, cluster: Cluster) -> None:
    main, startup = model.build()
    programs = transpile(main, startup, cluster).program_set
    params = {p.name: p for p in main.global_block().vars.values() if isinstance(p, Parameter) and p.trainable}
    # (origin, block name) → how many optimizer ops update it, over every pserver
    updates: dict[str, int] = {}
    slices: dict[str, list[tuple[int, int, int, str]]] = {name: [] for name in params}
    for role, progs in programs.items():
        if not role.startswith("pserver@"):
            continue
        g = progs.main.global_block()
        for name, var in g.vars.items():
            origin = var.slice_of if var.slice_of is not None else name
            if origin in params and var.copy_of is None and (var.slice_of is not None or name in params):
                offset = var.slice_offset if var.slice_of is not None else 0
                index = var.slice_index if var.slice_of is not None else 0
                assert offset is not None and index is not None
                assert var.shape[1:] == params[origin].shape[1:] and var.dtype == params[origin].dtype
                slices[origin].append((offset, var.shape[0], index, name))
        for block in progs.main.blocks:
            for op in block.ops:
                if "Param" in op.inputs and "LearningRate" in op.inputs:
                    for name in op.input("Param"):
                        updates[name] = updates.get(name, 0) + 1
    n_slices = len(cluster.pservers) if cluster.slice_var_up else 1
    for name, param in params.items():
        pieces = sorted(slices[name])
        assert pieces, f"{name} is held by no pserver"
        row = 0
        for index, (offset, rows, block_index, block) in enumerate(pieces):
            assert (offset, block_index) == (row, index), (name, pieces)
            assert updates.get(block) == 1, (name, block, updates.get(block))
            row += rows
        assert row == param.shape[0], (name, pieces)
        assert len(pieces) == expected_blocks(param.shape, n_slices, cluster.min_block_size), (name, pieces)


@PROPERTY_SETTINGS
@given(models(), clusters())
def test_transpile_is_deterministic_and_pure(model: Model, cluster: Cluster) -> None:
    main, startup = model.build()
    before = (main.to_string(), startup.to_string(), program_to_bytes(main), program_to_bytes(startup))
    t = transpile(main, startup, cluster)
    first = t.program_set
    assert (main.to_string(), startup.to_string(), program_to_bytes(main), program_to_bytes(startup)) == before
    # A fresh transpiler, a rebuilt input, and the same transpiler again: identical bytes.
    again = transpile(*model.build(), cluster).program_set
    t.transpile(cluster.trainer_id, program=main, pservers=",".join(cluster.pservers), trainers=cluster.trainers,
                sync_mode=cluster.sync, startup_program=startup)
    assert set_bytes(again) == set_bytes(first)
    assert set_bytes(t.program_set) == set_bytes(first)
    assert again.to_string() == first.to_string()
    assert (main.to_string(), startup.to_string()) == before[:2]


@PROPERTY_SETTINGS
@given(models(), clusters(), st.randoms(use_true_random=False))
def test_getters_in_any_order(model: Model, cluster: Cluster, rnd: Any) -> None:
    main, startup = model.build()
    t = transpile(main, startup, cluster)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("trainer", lambda: t.get_trainer_program(wait_port=False)),
        ("trainer_startup", t.get_trainer_startup_program),
    ]
    for ep in cluster.pservers:
        calls.append((f"pserver {ep}", lambda ep=ep: t.get_pserver_program(ep)))
        calls.append((f"startup {ep}", lambda ep=ep: t.get_startup_program(ep)))
    reference = {name: call().to_string() for name, call in calls}
    order = calls * 2
    rnd.shuffle(order)
    for name, call in order:
        program = call()
        assert program.to_string() == reference[name], name
        program.global_block().create_var("scribble", shape=(1,))  # a caller mutating a result
    for ep in cluster.pservers:
        main_ps, startup_ps = t.get_pserver_programs(ep)
        assert (main_ps.to_string(), startup_ps.to_string()) == (reference[f"pserver {ep}"],
                                                                 reference[f"startup {ep}"])


# --- HashName across processes -------------------------------------------------------------------------

HASH_SCRIPT = """
import ir
from flotilla.fluid import layers, optimizer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, HashName

main, startup = ir.Program(), ir.Program()
with ir.program_guard(main, startup):
    h = layers.data("x", [64])
    for width in (300, 200, 120, 50):
        h = layers.fc(h, width, act="relu")
    loss = layers.mean(layers.square_error_cost(layers.fc(h, 8), layers.data("y", [8])))
    optimizer.Adam(0.01).minimize(loss)
t = DistributeTranspiler(DistributeTranspilerConfig(split_method=HashName, min_block_size=1000))
t.transpile(0, program=main, startup_program=startup, trainers=2,
            pservers=",".join(f"127.0.0.1:{6170 + i}" for i in range(5)))
for pp in t.plan.params:
    for block, _, ep in pp.blocks():
        print(block.name, block.offset_rows, block.rows, ep)
print(t.program_set.to_string())
"""


def test_hash_name_placement_is_identical_across_processes() -> None:
    outputs = []
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", HASH_SCRIPT], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] == outputs[2]
    placement = [line.split() for line in outputs[0].splitlines() if line.startswith("fc_")]
    assert len(placement) > 5
    # The hash spreads blocks: more than one endpoint is used.
    assert len({row[-1] for row in placement}) > 1
