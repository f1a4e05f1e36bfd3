"""Flotilla's IR: Programs of Blocks of Operators over Variables, in the spirit of Fluid's ProgramDesc.

Imports only numpy, networkx and protobuf: transpiling and inspecting programs needs no jax or grpc.
"""
from __future__ import annotations

from ir import ops  # noqa: F401  (registers every op type)
from ir.core import (
    Block,
    Operator,
    Parameter,
    Program,
    Variable,
    default_main_program,
    default_startup_program,
    program_guard,
    switch_main_program,
    switch_startup_program,
)
from ir.errors import FlotillaError, IRError, ParseError, RegistryError, SerializationError, VerifyError
from ir.names import grad_name, block_name, trainer_copy_name, unique_name
from ir.ops.registry import BlockRef
from ir.program_set import ProgramRole, ProgramSet
from ir.roles import OpRole
from ir.parser import parse_program, parse_program_file
from ir.serialize import load_program, save_program
from ir.export import program_from_json, program_to_dot, program_to_json
from ir.verify import Problem, collect_problems, verify, verify_program_set
from ir.backward import append_backward

__all__ = [
    "Problem", "append_backward", "collect_problems", "load_program", "parse_program",
    "parse_program_file", "program_from_json", "program_to_dot", "program_to_json", "save_program", "verify",
    "verify_program_set",
    "Block", "BlockRef", "FlotillaError", "IRError", "OpRole", "Operator", "Parameter", "ParseError", "Program",
    "ProgramRole", "ProgramSet", "RegistryError", "SerializationError", "Variable", "VerifyError", "block_name",
    "default_main_program", "default_startup_program", "grad_name", "program_guard", "switch_main_program",
    "switch_startup_program", "trainer_copy_name", "unique_name",
]
