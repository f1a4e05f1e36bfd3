"""Errors raised by Flotilla.

Every error carries a stable ``code`` (for tools and tests to match on), a message that says
what was found and what was expected, and an optional ``hint`` that says how to fix it.
Validation never uses ``assert``: it raises one of these.
"""
from __future__ import annotations


class FlotillaError(Exception):
    """Base class of every error Flotilla raises on purpose."""

    code: str = "E000"

    def __init__(self, message: str, *, hint: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class IRError(FlotillaError):
    """Misuse of the IR API: unknown variable, duplicate name, bad slot, bad attribute value."""

    code = "E100"


class RegistryError(FlotillaError):
    """An op type is unknown or its definition is malformed."""

    code = "E200"


class ParseError(FlotillaError):
    """The text form could not be parsed; the message points at file:line:col with a caret."""

    code = "E300"


class SerializationError(FlotillaError):
    """A protobuf/JSON file is truncated, corrupted, or not a Flotilla program."""

    code = "E400"


class VerifyError(FlotillaError):
    """The verifier found problems; ``problems`` lists every one of them."""

    code = "E500"

    def __init__(self, problems: list, *, context: str | None = None) -> None:
        self.problems = list(problems)
        lines = [f"{len(self.problems)} problem(s) found by the verifier:"]
        lines += [f"  - {p}" for p in self.problems]
        if context:
            lines.append(context)
        super().__init__("\n".join(lines))
