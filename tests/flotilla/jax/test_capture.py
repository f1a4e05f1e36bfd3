"""The JAX capture front end (``flotilla.jax``): plain JAX models captured as Programs train like the
hand-written ``jax.value_and_grad`` loop, in one process, on parameter servers and with allreduce.

Tolerance: float32 models, rtol 1e-5 (atol 1e-6) on losses and parameters over 10 steps; Adam at a
learning rate of 1e-3 (larger rates amplify 1-ulp gradient differences of near-zero gradients, which
Adam normalises, beyond 1e-5), SGD for the CTR model (its embedding rows see tiny gradients).
Distributed runs start real processes on 127.0.0.1 ports from the OS, bound every wait and kill only
what they started.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime
from examples.jax_capture import models as M
from flotilla.fluid import optimizer
from ir.core import Variable
from ir.parser import parse_program
from ir.verify import verify
from flotilla.jax import CaptureError, capture
from runtime.kernels.jax_function import rows_held
from runtime.launch import free_ports
from tests.flotilla.jax import capture_worker

REPO = pathlib.Path(__file__).resolve().parents[3]
WAIT_S = 240.0
STEPS = 10


def train_captured(model: str, opt: str, lr: float, steps: int = STEPS, rows: int | None = None,
                   batches: list | None = None, **kw) -> tuple[dict[str, np.ndarray], list[float], object]:
    loss_fn, init, make = M.MODELS[model]
    data = batches if batches is not None else (make(1, steps) if rows is None else make(1, steps, rows))
    main, startup, loss = capture(loss_fn, init(0), data[0],
                                  optimizer=optimizer.Adam(lr) if opt == "adam" else optimizer.SGD(lr), **kw)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    losses = [float(exe.run(main, feed=b, fetch_list=[loss], scope=scope)[0].reshape(())) for b in data]
    names = [v.name for v in main.global_block().vars.values() if v.is_parameter]
    return {n: np.asarray(scope.find_var(n)) for n in names}, losses, main


@pytest.mark.parametrize("model,opt,lr", [("mlp", "adam", 1e-3), ("ctr", "sgd", 0.5), ("transformer", "adam", 1e-3),
                                          ("transformer", "sgd", 0.1)])
def test_captured_training_equals_value_and_grad_loop(model: str, opt: str, lr: float) -> None:
    loss_fn, init, make = M.MODELS[model]
    params, losses, _ = train_captured(model, opt, lr)
    ref, ref_losses = M.reference_train(loss_fn, init(0), make(1, STEPS), opt, lr)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    want = M.named(ref)
    assert set(params) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(value, M.named(init(0))[name]), f"{name} did not train"


def test_mlp_maps_every_equation_to_a_fluid_op() -> None:
    main, _, _ = capture(M.mlp_loss, M.mlp_init(0), M.mlp_batches(1, 1)[0])
    assert [op.type for op in main.global_block().ops] == [
        "mul", "elementwise_add", "relu", "mul", "elementwise_sub", "square", "mean"]
    block = main.global_block()
    assert block.var("x").shape == (-1, 32) and block.var("x").is_data
    assert all(block.var(n).is_parameter and block.var(n).persistable for n in ("w1", "b1", "w2"))


def test_ctr_embedding_is_a_sparse_lookup_table_and_the_rest_opaque() -> None:
    main, startup, _ = capture(M.ctr_loss, M.ctr_init(0), M.ctr_batches(1, 1)[0], optimizer=optimizer.SGD(0.1),
                               distributed=["emb"])
    ops = main.global_block().ops
    (lookup,) = [op for op in ops if op.type == "lookup_table"]
    assert lookup.input("W") == ["emb"] and lookup.attr("is_sparse") and lookup.attr("is_distributed")
    assert main.global_block().var("emb").is_distributed
    assert main.global_block().var("emb@GRAD").type == "selected_rows"
    (opaque,) = [op for op in ops if op.type == "jax_function"]
    assert opaque.attr("primitives") == ["broadcast_in_dim", "gather", "custom_jvp_call[logaddexp]"]
    assert opaque.attr("location").endswith("models.py:47")
    assert [op.type for op in startup.global_block().ops].count("load_value") == 5
    assert {"fc1.w", "fc1.b", "out.w", "out.b", "emb"} <= set(main.global_block().vars)


def test_transformer_uses_matmul_softmax_and_pytree_path_names() -> None:
    main, _, _ = capture(M.transformer_loss, M.transformer_init(0), M.transformer_batches(1, 1)[0])
    types = [op.type for op in main.global_block().ops]
    assert types.count("softmax") == 2 and types.count("matmul") == 4 and "lookup_table" in types
    assert main.global_block().var("blocks.1.attn.wq").is_parameter
    opaque = [op.attr("primitives") for op in main.global_block().ops if op.type == "jax_function"]
    assert ["jit[log_softmax]"] in opaque


def test_captured_program_prints_and_parses_back() -> None:
    main, startup, _ = capture(M.ctr_loss, M.ctr_init(0), M.ctr_batches(1, 1)[0], optimizer=optimizer.SGD(0.1))
    for prog in (main, startup):
        verify(prog)
        text = prog.to_string()
        assert parse_program(text).to_string() == text
    assert 'primitives=["broadcast_in_dim", "gather", "custom_jvp_call[logaddexp]"]' in str(main)


def test_batch_size_is_free() -> None:
    main, startup, loss = capture(M.mlp_loss, M.mlp_init(0), M.mlp_batches(1, 1, rows=4)[0])
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for rows in (3, 9):
        batch = M.mlp_batches(2, 1, rows=rows)[0]
        (got,) = exe.run(main, feed=batch, fetch_list=[loss], scope=scope)
        np.testing.assert_allclose(got.reshape(()), M.mlp_loss(M.mlp_init(0), batch), rtol=1e-6)


def test_opaque_batch_dependent_count_and_closure_constants() -> None:
    table = np.linspace(0.0, 1.0, 6, dtype=np.float32)

    def loss_fn(params, batch):
        z = jnp.cumsum(batch["x"] * params["w"], axis=1) + table  # cumsum has no Fluid op; table is a constant
        return jnp.mean(jnp.sort(z, axis=1)[:, -1]) + z.shape[0] * 0.0

    params = {"w": np.ones(6, np.float32) * 0.5}
    batch = {"x": np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)}
    main, startup, loss = capture(loss_fn, params, batch, optimizer=optimizer.SGD(0.1))
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for rows in (5, 7):
        b = {"x": np.random.default_rng(rows).normal(size=(rows, 6)).astype(np.float32)}
        (got, g) = exe.run(main, feed=b, fetch_list=[loss, "w@GRAD"], scope=scope)
        p = {"w": np.asarray(scope.find_var("w")) + 0}
        v, want_g = jax.value_and_grad(loss_fn)(p, b)
        # the run already applied SGD to w: recompute at the pre-update value
        pre = {"w": p["w"] + 0.1 * np.asarray(g)}
        np.testing.assert_allclose(got.reshape(()), loss_fn(pre, b), rtol=1e-6)
        np.testing.assert_allclose(g, jax.grad(loss_fn)(pre, b)["w"], rtol=1e-5, atol=1e-7)


# --- errors --------------------------------------------------------------------------------------------
def _branchy(params, batch):
    loss = jnp.mean(batch["x"] @ params["w"])
    if loss > 0:  # Python control flow on a traced value
        return loss
    return -loss


def test_python_control_flow_names_the_construct_and_line() -> None:
    with pytest.raises(CaptureError) as e:
        capture(_branchy, {"w": np.ones((3, 1), np.float32)}, {"x": np.ones((2, 3), np.float32)})
    msg = str(e.value)
    assert "Python control flow on a traced value" in msg
    assert f"test_capture.py:{_branchy.__code__.co_firstlineno + 2}" in msg and "if loss > 0" in msg


def test_side_effect_names_the_primitive_and_line() -> None:
    def noisy(params, batch):
        loss = jnp.mean(batch["x"] @ params["w"])
        jax.debug.print("loss {}", loss)
        return loss

    with pytest.raises(CaptureError, match=r"side effect.*debug_print.*test_capture.py:\d+: jax.debug.print"):
        capture(noisy, {"w": np.ones((3, 1), np.float32)}, {"x": np.ones((2, 3), np.float32)})


def test_unsupported_dtype_is_named() -> None:
    def complex_loss(params, batch):
        z = (batch["x"] @ params["w"]).astype(jnp.complex64)
        u = batch["x"] @ params["w"]  # a Fluid op in between: z must cross into a variable
        return jnp.mean(jnp.abs(z * 1j)) + jnp.mean(u)

    def complex_inside(params, batch):  # complex values that stay inside one opaque op are fine
        z = (batch["x"] @ params["w"]).astype(jnp.complex64)
        return jnp.mean(jnp.abs(z * 1j))

    capture(complex_inside, {"w": np.ones((3, 1), np.float32)}, {"x": np.ones((2, 3), np.float32)})

    with pytest.raises(CaptureError, match=r"unsupported dtype complex64.*convert_element_type.*test_capture.py:\d+"):
        capture(complex_loss, {"w": np.ones((3, 1), np.float32)}, {"x": np.ones((2, 3), np.float32)})
    with pytest.raises(CaptureError, match="parameter leaf 'w' has unsupported dtype"):
        capture(complex_loss, {"w": np.ones((3, 1), np.uint32)}, {"x": np.ones((2, 3), np.float32)})


def test_a_non_scalar_loss_is_refused() -> None:
    with pytest.raises(CaptureError, match="expected a scalar float loss"):
        capture(lambda p, b: b["x"] @ p["w"], {"w": np.ones((3, 1), np.float32)}, {"x": np.ones((2, 3), np.float32)})


def test_rows_held_by_slices_and_table_shards() -> None:
    whole = Variable("w", (10, 4))
    assert rows_held(whole, 10, 10) == slice(None)
    block = Variable("w.block1", (5, 4), slice_of="w", slice_index=1, slice_offset=5)
    assert rows_held(block, 10, 5) == slice(5, 10)
    shard = Variable("emb", (500, 8), slice_of="emb", slice_index=1, slice_offset=1)
    assert list(rows_held(shard, 1000, 500)[:3]) == [1, 3, 5]


# --- distributed ----------------------------------------------------------------------------------------

class _Procs:
    def __init__(self, out: pathlib.Path) -> None:
        self.out, self.procs = out, {}

    def start(self, tag: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.out / f"{tag}.log", "w")
        full = {**os.environ, "PYTHONPATH": str(REPO), **env}
        self.procs[tag] = subprocess.Popen([sys.executable, "-m", "tests.flotilla.jax.capture_worker", "--out",
                                            str(self.out), *args], env=full, cwd=REPO, stdout=log,
                                           stderr=subprocess.STDOUT)
        log.close()

    def wait(self) -> None:
        end = time.monotonic() + WAIT_S
        while any(p.poll() is None for p in self.procs.values()):
            failed = [t for t, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > end:
                self.kill()
                pytest.fail(f"{failed or 'timeout'}; logs:\n" + "\n".join(
                    f"--- {t}\n{(self.out / f'{t}.log').read_text()[-3000:]}" for t in self.procs))
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def procs(tmp_path: pathlib.Path):
    made = _Procs(tmp_path)
    yield made
    made.kill()


def _reference(model: str) -> dict[str, np.ndarray]:
    main, startup, loss, data = capture_worker.build(model)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    for batch in data:
        exe.run(main, feed=batch, fetch_list=[loss], scope=scope)
    return {n: np.asarray(scope.find_var(n)) for n in capture_worker.param_names(main)}


@pytest.mark.serial  # pservers and trainers as processes
def test_captured_ctr_on_two_pservers_two_trainers_equals_one_process(procs: _Procs, tmp_path: pathlib.Path) -> None:
    from transpiler import DistributeTranspiler

    main, startup, _, _ = capture_worker.build("ctr")
    t = DistributeTranspiler()
    t.transpile(0, program=main, startup_program=startup, pservers="127.0.0.1:1,127.0.0.1:2", trainers=2)
    trainer_types = [op.type for op in t.get_trainer_program().global_block().ops]
    assert "prefetch" in trainer_types and "lookup_table" not in trainer_types  # a distributed table
    assert not t.get_trainer_startup_program().global_block().has_var("emb")  # lives on the pservers only

    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
    base = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints), "PADDLE_TRAINERS_NUM": "2",
            "FLAGS_rpc_deadline": "60000"}
    for i, ep in enumerate(endpoints):
        procs.start(f"pserver.{i}", ["--model", "ctr"], {**base, "TRAINING_ROLE": "PSERVER",
                                                          "PADDLE_CURRENT_ENDPOINT": ep, "PADDLE_TRAINER_ID": "0"})
    for r in range(2):
        procs.start(f"trainer.{r}", ["--model", "ctr"],
                    {**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(r)})
    procs.wait()
    ref = _reference("ctr")
    trained = [dict(np.load(tmp_path / f"trainer_{r}.npz")) for r in range(2)]
    for name, value in trained[0].items():
        np.testing.assert_allclose(value, ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(value, trained[1][name])
    assert "emb" not in trained[0]
    shards = [np.load(tmp_path / f"pserver_{i}.npz")["emb"] for i in range(2)]
    table = np.zeros_like(ref["emb"])
    for i, shard in enumerate(shards):
        rows = np.arange(i, table.shape[0], 2)
        table[rows] = shard[rows // 2]
    np.testing.assert_allclose(table, ref["emb"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(table, M.ctr_init(0)["emb"])


@pytest.mark.serial  # a collective job of two processes
def test_captured_transformer_nccl2_two_processes_equals_one_process(procs: _Procs, tmp_path: pathlib.Path) -> None:
    endpoints = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    for r in range(2):
        procs.start(f"rank{r}", ["--model", "transformer", "--rank", str(r), "--endpoints", endpoints], {})
    procs.wait()
    ref = _reference("transformer")
    for r in range(2):
        got = dict(np.load(tmp_path / f"rank{r}.npz"))
        assert set(got) == set(ref)
        for name, value in ref.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"rank {r}: {name}")


@pytest.mark.serial  # a launched job
def test_example_trains_under_flotilla_launch_with_two_processes(tmp_path: pathlib.Path) -> None:
    from runtime.role import ROLE_ENV_VARS

    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    cmd = [sys.executable, "-m", "runtime.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "logs"),
           "examples/jax_capture/train.py", "--steps", "4", "--log-every", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=WAIT_S)
    assert proc.returncode == 0, proc.stdout[-4000:]
    finals = sorted(line for line in proc.stdout.splitlines() if "final loss:" in line)
    assert len(finals) == 2 and finals[0].startswith("[trainer.0]") and finals[1].startswith("[trainer.1]"), \
        proc.stdout[-2000:]


def test_a_distributed_table_must_be_read_only_by_row_gathers() -> None:
    def tied(params, batch):
        e = params["emb"][batch["ids"]].sum(axis=1)
        return jnp.mean(e @ params["emb"].T)

    params, batch = {"emb": np.ones((10, 4), np.float32)}, {"ids": np.zeros((2, 3), np.int32)}
    with pytest.raises(CaptureError, match=r"\['emb'\] are also read whole"):
        capture(tied, params, batch, distributed=["emb"])
    with pytest.raises(CaptureError, match="no row gather"):
        capture(M.mlp_loss, M.mlp_init(0), M.mlp_batches(1, 1)[0], distributed=["w1"])
    capture(tied, params, batch)  # not distributed: a sparse and a dense gradient, summed


def test_opaque_outputs_have_their_declared_shapes_and_dtypes() -> None:
    batch = M.ctr_batches(1, 1, rows=6)[0]
    main, startup, loss = capture(M.ctr_loss, M.ctr_init(0), M.ctr_batches(1, 1)[0])
    (op,) = [op for op in main.global_block().ops if op.type == "jax_function"]
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    values = exe.run(main, feed=batch, fetch_list=list(op.output("Out")), scope=scope)
    for name, value in zip(op.output("Out"), values):
        var = main.global_block().var(name)
        assert str(value.dtype) == var.dtype
        assert len(value.shape) == len(var.shape) and all(d in (-1, s) for d, s in zip(var.shape, value.shape))


def test_capture_traces_in_the_callers_jax_configuration() -> None:
    """Flotilla leaves JAX's global configuration alone: an untyped constant in a float32 model stays
    float32, as when the user calls the function; a 64-bit leaf declares 64-bit variables and is traced
    with 64-bit types, and JAX's configuration is unchanged afterwards."""
    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + jnp.zeros(2)) ** 2)

    params, batch = {"w": np.full((3, 2), 0.5, np.float32)}, {"x": np.arange(12, dtype=np.float32).reshape(4, 3)}
    main, startup, out = capture(loss, params, batch)
    plain = loss(params, batch)
    assert out.dtype == "float32" == str(plain.dtype)
    exe, scope = runtime.Executor(), runtime.Scope()
    exe.run(startup, scope=scope)
    (value,) = exe.run(main, feed=batch, fetch_list=[out], scope=scope)
    np.testing.assert_allclose(value.reshape(()), plain, rtol=1e-6)
    _, _, out64 = capture(loss, {"w": np.full((3, 2), 0.5)}, batch)  # float64 parameters
    assert out64.dtype == "float64"
    assert not jax.config.jax_enable_x64 and jnp.zeros(2).dtype == jnp.float32
