"""The frontend's logic (web/lib/*.js) and extension glue (web/comfy_metal.js) under node's
built-in test runner: `node --test tests/web` (node >= 20), counted in pytest."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

WEB_TESTS = pathlib.Path(__file__).resolve().parent   # tests/web


def test_web_logic_under_node():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the frontend's node --test suite (tests/web) was skipped")
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        pytest.skip(f"node {version} is older than 20: tests/web needs node's built-in test runner")
    files = sorted(str(p) for p in WEB_TESTS.glob("*.test.mjs"))
    assert files, "no tests/web/*.test.mjs found"
    proc = subprocess.run([node, "--test", *files], capture_output=True, text=True, timeout=120,
                          cwd=WEB_TESTS.parents[1])
    assert proc.returncode == 0, f"node --test failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "# fail 0" in proc.stdout
