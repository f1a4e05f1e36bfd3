"""Endpoint lists are checked where they are written (issue 21): ``"a:1;b:2"`` or ``"http://a:1"`` used to
pass as one endpoint, and a trainer then waited its whole deadline for a pserver that could not exist.
``ir.endpoints`` is the one parser; the transpiler (E701) and the role environment (E803) both use it."""
from __future__ import annotations

from typing import Any

import pytest

from ir import endpoints
from ir.errors import FlotillaError
from runtime.role import role_from_env
from tests.transpiler.test_transpiler_inputs import build_fc, fresh_names  # noqa: F401
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

BAD = [
    ("127.0.0.1:6174;127.0.0.1:6175", "127.0.0.1:6174;127.0.0.1:6175", "';'"),
    ("http://127.0.0.1:6174", "http://127.0.0.1:6174", "URL scheme 'http://'"),
    ("127.0.0.1:6174 127.0.0.1:6175", "127.0.0.1:6174 127.0.0.1:6175", "' '"),
    ("127.0.0.1:6174,999.0.0.1:6175", "999.0.0.1:6175", "not an IPv4 address"),
    ("127.0.0.1:6174,[zz]:6175", "[zz]:6175", "not an IPv6 address"),
    ("ho$t:6174", "ho$t:6174", "not a host name"),
    ("-host:6174", "-host:6174", "not a host name"),
    ("127.0.0.1:0", "127.0.0.1:0", "outside 1..65535"),
    ("127.0.0.1:65536", "127.0.0.1:65536", "outside 1..65535"),
]


@pytest.mark.parametrize("text, entry, problem", BAD)
def test_bad_list_names_the_entry(text: str, entry: str, problem: str) -> None:
    with pytest.raises(endpoints.EndpointSyntaxError) as info:
        endpoints.parse_endpoint_list(text, "pservers")
    assert f"pservers: endpoint {entry!r} is malformed" in info.value.message
    assert problem in info.value.message
    assert "host:port" in info.value.hint


@pytest.mark.parametrize("text, expected", [
    ("localhost:1,my-host.example.com:65535", ("localhost:1", "my-host.example.com:65535")),
    (" 127.0.0.1:06174 , [::1]:6175", ("127.0.0.1:6174", "[::1]:6175")),
    (["10.0.0.1:80", "node_1:81"], ("10.0.0.1:80", "node_1:81")),
])
def test_good_lists_are_canonical(text: Any, expected: tuple[str, ...]) -> None:
    assert endpoints.parse_endpoint_list(text, "pservers") == expected


def _expect(fn: Any, code: str, *fragments: str) -> None:
    with pytest.raises(FlotillaError) as info:
        fn()
    assert info.value.code == code, info.value
    for fragment in fragments:
        assert fragment in info.value.message, (fragment, info.value.message)
    assert "host:port" in info.value.hint


@pytest.mark.parametrize("text, entry, problem", BAD)
def test_transpile_refuses_bad_pservers(text: str, entry: str, problem: str) -> None:
    main, startup = build_fc()
    _expect(lambda: DistributeTranspiler().transpile(0, program=main, startup_program=startup, pservers=text,
                                                     trainers=1), "E701", f"pservers: endpoint {entry!r}", problem)


def test_transpile_refuses_bad_current_endpoint() -> None:
    main, startup = build_fc()
    _expect(lambda: DistributeTranspiler().transpile(0, program=main, startup_program=startup,
                                                     pservers="127.0.0.1:6174", current_endpoint="http://h:1"),
            "E701", "current_endpoint: endpoint 'http://h:1'")


def test_nccl2_trainers_are_checked() -> None:
    main, startup = build_fc()
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="nccl2"))
    _expect(lambda: t.transpile(0, program=main, startup_program=startup, trainers="127.0.0.1:6170;127.0.0.1:6171"),
            "E701", "trainers: endpoint '127.0.0.1:6170;127.0.0.1:6171'", "separate endpoints with a comma")
    _expect(lambda: t.transpile(0, program=main, startup_program=startup, trainers="127.0.0.1:6170,127.0.0.1:6171",
                                current_endpoint="127.0.0.1:6170:1"), "E701", "current_endpoint")


def test_get_pserver_program_takes_any_spelling_of_a_listed_endpoint() -> None:
    main, startup = build_fc()
    t = DistributeTranspiler()
    t.transpile(0, program=main, startup_program=startup, pservers="127.0.0.1:6174,127.0.0.1:6175", trainers=1)
    assert t.get_pserver_program(" 127.0.0.1:06175") is not None
    with pytest.raises(FlotillaError) as info:
        t.get_pserver_program("http://127.0.0.1:6175")
    assert info.value.code == "E706" and "URL scheme 'http://'" in info.value.hint


def test_role_environment_uses_the_same_parser() -> None:
    _expect(lambda: role_from_env({"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6174;127.0.0.1:6175"}), "E803",
            "PADDLE_PSERVERS_IP_PORT_LIST: endpoint '127.0.0.1:6174;127.0.0.1:6175'", "';'")
