"""Negative tests of ``DistributeTranspiler``'s inputs: every invalid input the issue lists raises a
``FlotillaError`` with a stable code, a message that names the problem, and a hint; and a failed
``transpile`` leaves the caller's programs as they were.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

import ir
from flotilla.fluid import layers, optimizer
from flotilla.fluid.param_attr import ParamAttr
from ir.core import Program
from ir.errors import FlotillaError
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

EP0, EP1 = "127.0.0.1:6174", "127.0.0.1:6175"


@pytest.fixture(autouse=True)
def fresh_names() -> Iterator[None]:
    with ir.unique_name.guard():
        yield


def build_fc(make_opt: Callable[[], Any] | None = lambda: optimizer.SGD(0.1)) -> tuple[Program, Program]:
    main, startup = Program(), Program()
    with ir.program_guard(main, startup):
        x = layers.data("x", [16])
        y = layers.data("y", [4])
        pred = layers.fc(x, 4)
        loss = layers.mean(layers.square_error_cost(pred, y))
        if make_opt is not None:
            make_opt().minimize(loss)
    return main, startup


def build_tables(n_tables: int, make_opt: Callable[[], Any] = lambda: optimizer.SGD(0.1)) -> tuple[Program, Program]:
    """``n_tables`` distributed embeddings (each its own table) summed into an fc."""
    main, startup = Program(), Program()
    with ir.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        embs = [layers.embedding(ids, [100, 8], is_sparse=True, is_distributed=True,
                                 param_attr=ParamAttr(name=f"table_{i}")) for i in range(n_tables)]
        feature = embs[0] if n_tables == 1 else layers.sums(embs)
        y = layers.data("y", [4])
        loss = layers.mean(layers.square_error_cost(layers.fc(feature, 4), y))
        make_opt().minimize(loss)
    return main, startup


def expect_error(fn: Callable[[], Any], code: str, *fragments: str) -> FlotillaError:
    with pytest.raises(FlotillaError) as info:
        fn()
    err = info.value
    assert err.code == code, (err.code, str(err))
    for fragment in fragments:
        assert fragment in err.message, (fragment, err.message)
    assert err.hint, f"{err.code} has no hint: {err.message}"
    return err


def transpile(main: Program, startup: Program, config: DistributeTranspilerConfig | None = None,
              **kwargs: Any) -> DistributeTranspiler:
    args: dict[str, Any] = {"trainer_id": 0, "pservers": f"{EP0},{EP1}", "trainers": 2}
    args.update(kwargs)
    t = DistributeTranspiler(config)
    t.transpile(args.pop("trainer_id"), program=main, startup_program=startup, **args)
    return t


# --- endpoints -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pservers, fragments",
    [
        ("", ("pservers is empty",)),
        ([], ("pservers is empty",)),
        (f"{EP0},{EP0}", ("more than once", EP0)),
        (f"{EP0}, {EP1},{EP1}", ("more than once", EP1)),
        ("host", ("endpoint 'host' is malformed", "host:port")),
        ("host:0", ("endpoint 'host:0' is malformed", "port in 1..65535")),
        ("host:70000", ("endpoint 'host:70000' is malformed", "port in 1..65535")),
        (":1", ("endpoint ':1' is malformed",)),
        ("host:port", ("endpoint 'host:port' is malformed",)),
        (f"{EP0},", ("item 1", "is empty")),
        (6174, ("pservers must be a comma-separated string",)),
    ],
)
def test_bad_pservers(pservers: Any, fragments: tuple[str, ...]) -> None:
    main, startup = build_fc()
    expect_error(lambda: transpile(main, startup, pservers=pservers), "E701", *fragments)


def test_bad_current_endpoint() -> None:
    main, startup = build_fc()
    expect_error(lambda: transpile(main, startup, current_endpoint="localhost"), "E701", "'localhost' is malformed")


# --- trainers and trainer_id ---------------------------------------------------------------------------


@pytest.mark.parametrize("trainers", [0, -3, "2", 2.0, True, None])
def test_bad_trainers(trainers: Any) -> None:
    main, startup = build_fc()
    expect_error(lambda: transpile(main, startup, trainers=trainers), "E702",
                 f"trainers must be an int >= 1 in pserver mode, got {trainers!r}")


@pytest.mark.parametrize("trainer_id, trainers", [(-1, 2), (2, 2), (5, 1), ("0", 2), (None, 2), (False, 2)])
def test_trainer_id_out_of_range(trainer_id: Any, trainers: int) -> None:
    main, startup = build_fc()
    expect_error(lambda: transpile(main, startup, trainer_id=trainer_id, trainers=trainers), "E703",
                 f"trainer_id {trainer_id!r} is out of range", f"0..{trainers - 1}")


# --- programs ------------------------------------------------------------------------------------------


def test_program_without_optimizer_ops() -> None:
    main, startup = build_fc(None)
    expect_error(lambda: transpile(main, startup), "E601", "no optimizer ops")


def test_program_argument_not_a_program() -> None:
    _, startup = build_fc()
    with pytest.raises(FlotillaError) as info:
        transpile("main.pb", startup)  # type: ignore[arg-type]
    assert info.value.code == "E712"
    assert "program must be a Program, got str" in info.value.message


def test_several_distributed_tables() -> None:
    main, startup = build_tables(2)
    expect_error(lambda: transpile(main, startup), "E602", "found 2 distributed lookup tables",
                 "'table_0'", "'table_1'", "expected at most one")


@pytest.mark.parametrize("make_opt, kind", [(lambda: optimizer.Momentum(0.1, 0.9), "momentum"),
                                            (lambda: optimizer.RMSProp(0.1), "rmsprop"),
                                            (lambda: optimizer.Ftrl(0.1), "ftrl")])
def test_table_optimizer_the_pserver_cannot_run(make_opt: Callable[[], Any], kind: str) -> None:
    # Fluid silently fell back to SGD here; we refuse, naming the optimizer and what would work.
    main, startup = build_tables(1, make_opt)
    err = expect_error(lambda: transpile(main, startup), "E604", "'table_0'", f"uses optimizer {kind!r}",
                       "no sparse update on the pserver", "'sgd', 'adagrad', 'adam'")
    assert "SGD, Adagrad or Adam" in (err.hint or "")


# --- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1.5, "8192", True])
def test_bad_min_block_size(size: Any) -> None:
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(min_block_size=size)), "E705",
                 f"min_block_size must be an int >= 1, got {size!r}")


def test_dc_asgd_needs_async() -> None:
    main, startup = build_fc()
    config = DistributeTranspilerConfig(enable_dc_asgd=True)
    expect_error(lambda: transpile(main, startup, config, sync_mode=True), "E709",
                 "enable_dc_asgd needs asynchronous training", "sync_mode is True")


def test_bad_split_method() -> None:
    expect_error(lambda: DistributeTranspiler(DistributeTranspilerConfig(split_method=str)),  # type: ignore[arg-type]
                 "E718", "split_method must be a PSDispatcher subclass")


# --- results -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("getter", ["get_pserver_program", "get_startup_program", "get_pserver_programs"])
@pytest.mark.parametrize("endpoint", ["127.0.0.1:6176", "6174", "", None])
def test_endpoint_not_in_pserver_list(getter: str, endpoint: Any) -> None:
    main, startup = build_fc()
    t = transpile(main, startup)
    expect_error(lambda: getattr(t, getter)(endpoint), "E706", f"endpoint {endpoint!r} is not one of the pservers",
                 EP0, EP1)


@pytest.mark.parametrize("getter", ["get_trainer_program", "get_trainer_startup_program"])
def test_results_before_transpile(getter: str) -> None:
    expect_error(lambda: getattr(DistributeTranspiler(), getter)(), "E713", "transpile() has not been called")


# --- a failed transpile changes nothing ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"pservers": "host"}, {"trainers": 0}, {"trainer_id": 9}])
def test_failed_transpile_leaves_inputs_and_previous_result(kwargs: dict[str, Any]) -> None:
    main, startup = build_fc()
    before = (main.to_string(), startup.to_string())
    t = transpile(main, startup)
    result = t.get_trainer_program(wait_port=False).to_string()
    with pytest.raises(FlotillaError):
        t.transpile(kwargs.get("trainer_id", 0), program=main, startup_program=startup,
                    pservers=kwargs.get("pservers", EP0), trainers=kwargs.get("trainers", 2))
    assert (main.to_string(), startup.to_string()) == before
    assert t.get_trainer_program(wait_port=False).to_string() == result
