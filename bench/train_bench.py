"""Training step benchmark: ``runtime.Executor`` against a hand-written ``jax.jit`` step of the same
model, and against op-by-op eager execution of the same program, measured in the same run.

Models: the MLP example (``examples/mlp``: 32 → 128 → 64 → 10, softmax cross entropy) and the CTR
example (``examples/ctr``: wide and deep, 26 slots into one [hash_dim, 16] sparse table, fc 400-400-400,
AUC statistics), both trained with SGD at batch 512 on CPU; and ``captured_mlp``, the plain-JAX MLP of
``examples/jax_capture`` captured as a Program by ``flotilla.jax`` (its jax.jit step is the same
``loss_fn`` under ``jax.value_and_grad``; the issue's target for it is executor / jax.jit <= 1.1).

The three ways run one model from the same initial parameters (the startup program's values, copied)
over the same batches:

- ``executor``: ``Executor.run(main, feed, fetch_list=[loss])``;
- ``jax.jit``: the model written directly in ``jax.numpy`` — forward, ``jax.grad``, SGD (sparse tables
  updated by a scatter-add of the gathered rows' gradients, as the sparse SGD kernel does; the CTR step
  also updates the AUC statistics, as the program's ``auc`` ops do) — one jitted function with the
  parameters donated, fetching the loss to the host each step as the executor does;
- ``eager``: every op of the main block run through its registered kernel
  (``runtime.kernels.registry.get_kernel``) without ``jax.jit``, over a dict scope.

The losses of the first warm-up steps are compared across the three (they must agree, or the step
being timed is not the same model). Then each way is timed ``--repeats`` times over as many steps as
take about ``--sample-s`` seconds (or ``--steps``, a tenth of it for eager), the three taking turns within each repeat so that load from other processes
falls on them alike; the table shows the median ms/step, the ratios to ``jax.jit`` and the
executor / jax.jit ratio of the fastest repeats (steadier on a loaded machine). The
target is executor / jax.jit <= 1.15. ``python bench/train_bench.py [--steps N] [--repeats R]``.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import runtime  # noqa: E402
from examples.ctr import model as ctr_model  # noqa: E402
from examples.mlp import data as mlp_data  # noqa: E402
from examples.mlp import model as mlp_model  # noqa: E402
from ir.core import Block, Program  # noqa: E402
from ir.errors import FlotillaError  # noqa: E402
from ir.names import EMPTY_VAR_NAME  # noqa: E402
from runtime.kernels.registry import get_kernel  # noqa: E402
from runtime.x64 import x64  # noqa: E402

Batch = dict[str, np.ndarray]
BATCH_SIZE = 512
NUM_BATCHES = 8
LOSS_RTOL = 2e-3
TARGET = 1.15


@dataclass
class Case:
    """One model: its programs, the loss name, initial values of every persistable, batches and the
    hand-written jitted step ``(params, batch) -> (params, loss)``."""

    name: str
    main: Program
    loss: str
    init: dict[str, np.ndarray]
    batches: list[Batch]
    jax_step: Callable[[dict[str, Any], Batch], tuple[dict[str, Any], Any]]
    jax_params: Callable[[dict[str, np.ndarray]], dict[str, Any]]


# --- the three ways to run a step ---------------------------------------------------------------------
class ExecutorRunner:
    def __init__(self, case: Case) -> None:
        self.case = case
        self.exe = runtime.Executor(runtime.CPUPlace())
        self.scope = runtime.Scope()
        for name, value in case.init.items():
            self.scope.set_var(name, jnp.array(value))

    def step(self, batch: Batch) -> float:
        (loss,) = self.exe.run(self.case.main, feed=batch, fetch_list=[self.case.loss], scope=self.scope)
        return float(loss.ravel()[0])


class JaxRunner:
    def __init__(self, case: Case) -> None:
        self.case = case
        self.params = case.jax_params({k: v.copy() for k, v in case.init.items()})

    def step(self, batch: Batch) -> float:
        self.params, loss = self.case.jax_step(self.params, batch)
        return float(np.asarray(loss).ravel()[0])


class EagerRunner:
    """Each op of the main block through its kernel, unjitted, over a dict scope."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.block: Block = case.main.global_block()
        self.ops = [(op, get_kernel(op.type), dict(op.attrs)) for op in self.block.ops]
        self.env: dict[str, Any] = {k: jnp.array(v) for k, v in case.init.items()}

    def step(self, batch: Batch) -> float:
        env = self.env
        env.update({k: jnp.asarray(v) for k, v in batch.items()})
        for op, kern, attrs in self.ops:
            ins = {slot: [env[n] for n in names if n != EMPTY_VAR_NAME] for slot, names in op.inputs.items()}
            outs = kern(ins, attrs)
            for slot, names in op.outputs.items():
                for n, v in zip(names, outs.get(slot, [])):
                    if n != EMPTY_VAR_NAME:
                        env[n] = v
        return float(np.asarray(env[self.case.loss]).ravel()[0])


# --- the models ---------------------------------------------------------------------------------------
def _initial_values(startup: Program, main: Program) -> dict[str, np.ndarray]:
    scope = runtime.Scope()
    runtime.Executor(runtime.CPUPlace()).run(startup, scope=scope)
    names = [v.name for v in main.list_vars() if v.persistable]
    return {n: np.array(scope.numpy(n)) for n in names}


def _sgd(params: dict[str, Any], grads: dict[str, Any], lr: float) -> dict[str, Any]:
    return {k: params[k] - jnp.asarray(lr, params[k].dtype) * grads[k] for k in grads}


def mlp_case(hidden: tuple[int, ...] = (128, 64), lr: float = 0.1) -> Case:
    model = mlp_model.build_model(mlp_data.DIM, mlp_data.NUM_CLASSES, hidden=hidden, learning_rate=lr)
    x, y = mlp_data.generate(BATCH_SIZE * NUM_BATCHES, seed=0)
    batches = [{"x": bx, "label": by} for bx, by in mlp_data.batches(x, y, BATCH_SIZE)]
    layers = len(hidden) + 1

    def loss_fn(p: dict[str, Any], batch: Batch) -> Any:
        h = batch["x"]
        for i in range(layers):
            h = h @ p[f"fc_{i}.w_0"] + p[f"fc_{i}.b_0"]
            if i < layers - 1:
                h = jax.nn.relu(h)
        log_p = jax.nn.log_softmax(h, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_p, batch["label"], axis=-1))

    def step(p: dict[str, Any], batch: Batch) -> tuple[dict[str, Any], Any]:
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        return _sgd(p, grads, lr), loss.reshape(1)

    def params(init: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: jnp.array(v) for k, v in init.items() if k.startswith("fc_")}

    return Case("mlp", model.main, model.loss.name, _initial_values(model.startup, model.main), batches,
                jax.jit(step, donate_argnums=(0,)), params)


def ctr_case(hash_dim: int = 100_003, lr: float = 0.05) -> Case:
    emb_dim, hidden = 16, (400, 400, 400)
    model = ctr_model.build_model(hash_dim, embedding_dim=emb_dim, hidden=hidden, optimizer_name="sgd",
                                  learning_rate=lr)
    rng = np.random.default_rng(0)
    batches = [{"dense_input": rng.random((BATCH_SIZE, ctr_model.NUM_DENSE), np.float32),
                "sparse_input": rng.zipf(1.2, size=(BATCH_SIZE, ctr_model.NUM_SPARSE)).astype(np.int64) % hash_dim,
                "label": (rng.random((BATCH_SIZE, 1)) < 0.3).astype(np.int64)}
               for _ in range(NUM_BATCHES)]
    states = [v.name for v in model.auc_states]  # batch_pos, batch_neg (sliding, 1 row), pos, neg (global)
    nt = 4095

    def loss_fn(dense_p: dict[str, Any], deep_rows: Any, wide_rows: Any, batch: Batch) -> tuple[Any, Any]:
        n = batch["dense_input"].shape[0]
        h = jnp.concatenate([deep_rows.reshape(n, -1), batch["dense_input"]], axis=1)
        for i in range(len(hidden)):
            h = jax.nn.relu(h @ dense_p[f"fc_{i}.w_0"] + dense_p[f"fc_{i}.b_0"])
        wide = wide_rows.sum(axis=1)
        last = len(hidden)
        logits = h @ dense_p[f"fc_{last}.w_0"] + wide @ dense_p[f"fc_{last}.w_1"] + dense_p[f"fc_{last}.b_0"]
        predict = jax.nn.softmax(logits, axis=-1)
        loss = -jnp.mean(jnp.log(jnp.take_along_axis(predict, batch["label"], axis=-1)))
        return loss, predict

    def step(p: dict[str, Any], batch: Batch) -> tuple[dict[str, Any], Any]:
        ids = batch["sparse_input"]
        dense_p = {k: v for k, v in p.items() if k.startswith("fc_")}
        deep_rows, wide_rows = p["deep_embedding"][ids], p["wide_embedding"][ids]
        (loss, predict), (g_dense, g_deep, g_wide) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(
            dense_p, deep_rows, wide_rows, batch)
        new = _sgd(dense_p, g_dense, lr)
        flat = ids.reshape(-1)
        new["deep_embedding"] = p["deep_embedding"].at[flat].add(-lr * g_deep.reshape(-1, emb_dim))
        new["wide_embedding"] = p["wide_embedding"].at[flat].add(-lr * g_wide.reshape(-1, 1))
        bucket = jnp.clip(jnp.floor(predict[:, -1] * nt).astype(jnp.int64), 0, nt)
        is_pos = batch["label"].reshape(-1) != 0
        batch_pos = jnp.zeros(nt + 1, jnp.int64).at[bucket].add(is_pos.astype(jnp.int64))
        batch_neg = jnp.zeros(nt + 1, jnp.int64).at[bucket].add((~is_pos).astype(jnp.int64))
        new[states[0]], new[states[1]] = batch_pos[None], batch_neg[None]
        new[states[2]] = p[states[2]] + batch_pos[None]
        new[states[3]] = p[states[3]] + batch_neg[None]
        return new, loss.reshape(1)

    def params(init: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: jnp.array(v) for k, v in init.items() if k != "learning_rate_0"}

    return Case("ctr", model.main, model.loss.name, _initial_values(model.startup, model.main), batches,
                jax.jit(step, donate_argnums=(0,)), params)


# --- timing ---------------------------------------------------------------------------------------------
def captured_mlp_case(lr: float = 0.1) -> Case:
    """The plain-JAX MLP of ``examples/jax_capture`` (32 → 128 relu → 10, squared error) captured by
    ``flotilla.jax`` (SGD), against the same ``loss_fn`` under ``jax.value_and_grad`` + SGD, jitted."""
    from examples.jax_capture import models as jc
    from flotilla.fluid import optimizer
    from flotilla.jax import capture

    params = jc.mlp_init(0, d_in=32, hidden=128, d_out=10)
    batches = jc.mlp_batches(1, NUM_BATCHES, rows=BATCH_SIZE, d_in=32, d_out=10)
    main, startup, loss = capture(jc.mlp_loss, params, batches[0], optimizer=optimizer.SGD(lr))

    def step(p: dict[str, Any], batch: Batch) -> tuple[dict[str, Any], Any]:
        value, grads = jax.value_and_grad(jc.mlp_loss)(p, batch)
        return _sgd(p, grads, lr), value.reshape(1)

    return Case("captured_mlp", main, loss.name, _initial_values(startup, main), batches,
                jax.jit(step, donate_argnums=(0,)), lambda init: {k: jnp.array(init[k]) for k in params})


def _cycle(batches: list[Batch]) -> Iterator[Batch]:
    while True:
        yield from batches


def time_runners(runners: dict[str, Callable[[Batch], float]], batches: list[Batch], steps: dict[str, int],
                 repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of each runner's mean ms/step over ``steps[name]`` steps (and, as
    ``NAME best``, the fastest repeat). The runners take turns within every repeat, so load from other
    processes affects them alike."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    feed = _cycle(batches)
    for _ in range(repeats):
        for name, step in runners.items():
            start = time.perf_counter()
            for _ in range(steps[name]):
                step(next(feed))
            samples[name].append((time.perf_counter() - start) / steps[name] * 1e3)
    result = {name: statistics.median(values) for name, values in samples.items()}
    result.update({f"{name} best": min(values) for name, values in samples.items()})
    return result


def bench_case(case: Case, steps: int, repeats: int, warmup: int, sample_s: float) -> dict[str, float]:
    runners = {"executor": ExecutorRunner(case), "jax.jit": JaxRunner(case), "eager": EagerRunner(case)}
    losses = {name: [r.step(b) for b in case.batches[:warmup]] for name, r in runners.items()}
    ref = np.array(losses["jax.jit"])
    for name, values in losses.items():
        if not np.allclose(values, ref, rtol=LOSS_RTOL, atol=1e-5):
            raise FlotillaError(f"{case.name}: the {name} losses {values} differ from jax.jit's {list(ref)}",
                                hint="the steps being timed are not the same model: check the hand-written step")
    print(f"{case.name}: losses of the first {warmup} steps agree across the three "
          f"(jax.jit: {', '.join(f'{v:.4f}' for v in ref)})", flush=True)
    if steps <= 0:
        steps = {name: _calibrate(r.step, case.batches, sample_s) for name, r in runners.items()}
    else:
        steps = {name: max(1, steps // 10) if name == "eager" else steps for name in runners}
    return time_runners({name: r.step for name, r in runners.items()}, case.batches, steps, repeats)


def _calibrate(step: Callable[[Batch], float], batches: list[Batch], sample_s: float) -> int:
    """Steps that take about ``sample_s`` seconds (3 to 1000)."""
    start = time.perf_counter()
    for b in batches[:3]:
        step(b)
    per_step = (time.perf_counter() - start) / 3
    return int(min(1000, max(3, round(sample_s / per_step))))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description="Executor vs hand-written jax.jit vs eager training steps.")
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps a repeat (eager: a tenth); 0: as many as take --sample-s seconds")
    ap.add_argument("--sample-s", type=float, default=0.3, help="seconds a timed sample with --steps 0")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps, compared across the three ways")
    ap.add_argument("--hash-dim", type=int, default=100_003)
    ap.add_argument("--models", nargs="+", choices=("mlp", "ctr", "captured_mlp"),
                    default=["mlp", "ctr", "captured_mlp"])
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, batch {BATCH_SIZE}", flush=True)
    results = {}
    for name in args.models:
        # The hand-written and eager steps compute with the 64-bit types the Executor's runs have (int64 ids).
        with x64():
            case = {"mlp": mlp_case, "captured_mlp": captured_mlp_case}.get(name, lambda: ctr_case(args.hash_dim))()
            results[name] = bench_case(case, args.steps, args.repeats, args.warmup, args.sample_s)
    print()
    print(f"{'model':<12} {'executor ms':>12} {'jax.jit ms':>11} {'eager ms':>10} {'exec/jit':>9} {'eager/jit':>10}"
          f" {'exec/eager':>11} {'exec/jit best':>14}")
    for name, r in results.items():
        print(f"{name:<12} {r['executor']:12.3f} {r['jax.jit']:11.3f} {r['eager']:10.1f} "
              f"{r['executor'] / r['jax.jit']:9.2f} {r['eager'] / r['jax.jit']:10.1f} "
              f"{r['executor'] / r['eager']:11.3f} {r['executor best'] / r['jax.jit best']:14.2f}")
    for name, r in results.items():
        ratio = r["executor"] / r["jax.jit"]
        print(f"{name}: executor / jax.jit = {ratio:.2f} ({'meets' if ratio <= TARGET else 'misses'} the target "
              f"<= {TARGET})")
    return results


if __name__ == "__main__":
    main()
