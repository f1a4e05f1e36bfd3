"""Every ```python block of README.md runs as written.

The blocks run in order, in one namespace, in one fresh interpreter started in an empty directory (the
README reads top to bottom like a notebook: a later block may use what an earlier one built), with no
role variables in the environment (a local, single-process job). A block whose fence is preceded by the
line ``<!-- not-run -->`` is skipped: only for code that cannot finish in one process (a parameter
server's ``exe.run(pserver_main)`` serves until its trainers complete). A failure names the block's
README line and shows the traceback, whose line numbers are README's.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

from runtime.role import ROLE_ENV_VARS

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
NOT_RUN = "<!-- not-run -->"
TIMEOUT_S = 300

_FENCE = re.compile(r"^```python[ \t]*$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line of the first code line, code, runs)`` for every ```python block, in order."""
    lines = text.splitlines()
    blocks: list[tuple[int, str, bool]] = []
    index = 0
    while index < len(lines):
        if _FENCE.match(lines[index]):
            start = index + 1
            end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise AssertionError(f"README.md:{index + 1}: a ```python block is never closed")
            previous = next((lines[j].strip() for j in range(index - 1, -1, -1) if lines[j].strip()), "")
            blocks.append((start + 1, "\n".join(lines[start:end]) + "\n", previous != NOT_RUN))
            index = end
        index += 1
    return blocks


_DRIVER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(sys.stdin)
    namespace = {"__name__": "__readme__"}
    for line, code in blocks:
        try:
            exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
        except BaseException:
            print(f"README.md:{line}: this python block failed:", file=sys.stderr)
            traceback.print_exc()
            sys.exit(1)
        print(f"README.md:{line}: ok", flush=True)
""")


def test_python_blocks_parse_and_extraction() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- not-run -->\n\n```python\nserve()\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", True), (8, "serve()\n", False)]


def test_every_python_block_of_the_readme_runs(tmp_path: pathlib.Path) -> None:
    import json

    blocks = python_blocks(README.read_text())
    for line, code, _ in blocks:
        compile(code, f"README.md:{line}", "exec")  # every block, run or not, is valid Python
    runnable = [(line, code) for line, code, runs in blocks if runs]
    env = {k: v for k, v in os.environ.items() if k not in ROLE_ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(runnable), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert done.stdout.count(": ok") == len(runnable)
