"""Tests of the transpiler package and the ``flotilla`` command-line tool."""
