"""Every field of Fluid 1.5's and 1.6's ``DistributeTranspilerConfig`` is accepted with its meaning, or
refused with a hint that names what to do instead (issue 21): a ported script's assignments must not die
on "no field" nor be silently ignored."""
from __future__ import annotations

from typing import Any

import pytest

import ir
from ir.printer import format_program
from tests.transpiler.test_transpiler_inputs import EP0, build_fc, expect_error, fresh_names, transpile  # noqa: F401
from transpiler import DistributeTranspilerConfig

#: Fluid 1.5 / 1.6 fields and a value a script may set (the Fluid default, or a typical setting).
FLUID_FIELDS: dict[str, Any] = {
    "slice_var_up": True, "split_method": None, "min_block_size": 8192, "enable_dc_asgd": False,
    "mode": "pserver", "print_log": False, "wait_port": True, "runtime_split_send_recv": False,
    "sync_mode": True, "nccl_comm_num": 1, "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 0, "collective_mode": None, "geo_sgd_mode": False,
    "geo_sgd_need_push_nums": 100, "half_async": False, "completely_not_async": False,
}


def _config(**fields: Any) -> DistributeTranspilerConfig:
    config = DistributeTranspilerConfig()
    for name, value in fields.items():
        setattr(config, name, value)  # field by field, as Fluid scripts do
    return config


def test_every_fluid_field_is_accepted() -> None:
    main, startup = build_fc()
    t = transpile(main, startup, _config(**FLUID_FIELDS))
    assert t.plan.sync_mode is True


@pytest.mark.parametrize("fields, argument, expected", [
    ({}, True, True),
    ({}, False, False),
    ({"sync_mode": False}, True, False),  # Fluid 1.6 scripts set only the config
    ({"sync_mode": True}, False, True),
    ({"completely_not_async": True}, False, True),
    ({"sync_mode": False, "runtime_split_send_recv": True}, True, False),
])
def test_sync_mode_of_the_config_wins(fields: dict[str, Any], argument: bool, expected: bool) -> None:
    main, startup = build_fc()
    t = transpile(main, startup, _config(**fields), sync_mode=argument)
    assert t.plan.sync_mode is expected
    listen = [op for op in t.get_pserver_program(EP0).global_block().ops if op.type == "listen_and_serv"]
    assert listen and listen[0].attrs["sync_mode"] is expected


def test_runtime_split_send_recv_trains_the_same() -> None:
    """Fluid split inside send/recv instead of with ops; the values exchanged are the same, so are the programs."""
    texts = []
    for split in (False, True):
        with ir.unique_name.guard():
            main, startup = build_fc()
        t = transpile(main, startup, _config(sync_mode=False, runtime_split_send_recv=split))
        texts.append((format_program(t.get_trainer_program()), format_program(t.get_pserver_program(EP0))))
    assert texts[0] == texts[1]


@pytest.mark.parametrize("fields, fragments, hint", [
    ({"half_async": True}, ["half_async is not supported"], "sync_mode=False"),
    ({"sync_mode": "yes"}, ["sync_mode must be True, False or None", "'yes'"], "None"),
    ({"hierarchical_allreduce_inter_nranks": -1}, ["hierarchical_allreduce_inter_nranks", "-1"], "leave it 0"),
    ({"completely_not_async": True, "sync_mode": False}, ["completely_not_async", "sync_mode=False"], "unset one"),
])
def test_refused_fields_say_what_to_do(fields: dict[str, Any], fragments: list[str], hint: str) -> None:
    main, startup = build_fc()
    err = expect_error(lambda: transpile(main, startup, _config(**fields)), "E721", *fragments)
    assert hint in err.hint


def test_config_sync_mode_meets_dc_asgd_check() -> None:
    """The resolved mode, not the argument, is what the async-only options are checked against."""
    main, startup = build_fc()
    expect_error(lambda: transpile(main, startup, _config(enable_dc_asgd=True, sync_mode=True), sync_mode=False),
                 "E709", "sync_mode is True")
    transpile(main, startup, _config(enable_dc_asgd=True, sync_mode=False))
