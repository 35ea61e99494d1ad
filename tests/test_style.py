"""The code is formatted and lint-clean, as `pyproject.toml` configures ruff."""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

# The source's layout and style: the same whichever backend runs.
pytestmark = pytest.mark.one_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed (it comes with the test extras)")
    return ruff


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    result = subprocess.run(
        [_ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# -- the layout of the package (docs/design.md, "Layout") ----------------------

PACKAGE = os.path.join(ROOT, "keras_mp")
MAX_LINES = 400


def _modules():
    """(path relative to keras_mp/, lines) of every module of the package."""
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


def test_no_module_is_over_400_lines():
    long = {path: text.count("\n") for path, text in _modules() if text.count("\n") > MAX_LINES}
    assert not long, f"split these by concern (at most {MAX_LINES} lines): {long}"


def test_each_module_has_a_test_file_named_after_it():
    """`keras_mp/_src/precision/rules.py` -> `tests/precision/test_rules.py`; `_src/backends/jax.py`
    -> `tests/backends/test_jax.py`. Package `__init__`s re-export (the
    public names are `test_loss_scale_optimizer.py::test_public_names`)."""
    missing = []
    for path, text in _modules():
        folder, name = os.path.split(path)
        if name == "__init__.py" or text.count("\n") < 20:
            continue
        tests = os.path.join(ROOT, "tests", *folder.split(os.sep)[1:], f"test_{name}")
        if not os.path.exists(tests):
            missing.append(f"{path} -> {os.path.relpath(tests, ROOT)}")
    assert not missing, missing


def _lines_with(pattern, allowed):
    found = []
    for path, text in _modules():
        if any(path.startswith(a) for a in allowed):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                found.append(f"{path}:{number}: {line.strip()}")
    return found


def test_keras_internals_are_used_in_one_module():
    assert not _lines_with(r"keras\.src\b", ["_src/keras_internals/"])


def test_backend_switches_are_in_backends():
    assert not _lines_with(r"backend\(\)", ["_src/backends/"])


def test_level_names_are_compared_nowhere_but_in_the_level_table():
    """A level is resolved once (`amp_settings.py`); code asks it what it
    means (`amp.compute`, `amp.half_variables`), never which it is."""
    assert not _lines_with(r"""(==|!=|\bin)\s*\(?\s*["']O[0-3]["']""", ["_src/precision/levels.py"])


def test_compiled_graph_checks_carry_the_perf_marker():
    """Checks of compiled-graph structure (HLO text) are kept apart: `-m perf`
    runs them, `-m "not perf"` leaves them out."""
    unmarked = []
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        if path == os.path.abspath(__file__):
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            source = ast.unparse(node)
            if "compiler_ir" in source or re.search(r"\.as_text\(\)|\bENTRY\b", source):
                marks = [ast.unparse(d) for d in node.decorator_list]
                if not any("mark.perf" in m for m in marks):
                    unmarked.append(f"{os.path.relpath(path, ROOT)}::{node.name}")
    assert not unmarked, unmarked


# What each folder of `_src` may import (its `__init__.py` says why):
# precision, optimizer and backends never import model or tools; model
# never imports tools; tools import anything.
FORBIDDEN_IMPORTS = {
    "precision": ("model", "tools"),
    "optimizer": ("model", "tools"),
    "backends": ("model", "tools"),
    "model": ("tools",),
}


def _imported_groups(text):
    """The `_src` folders a module's text imports, at any indentation."""
    groups = set(re.findall(r"from keras_mp\._src\.(\w+)", text))
    groups |= set(re.findall(r"from keras_mp\._src import (\w+)", text))
    return groups


def test_each_folder_imports_only_what_its_docstring_allows():
    wrong = []
    for path, text in _modules():
        parts = path.split(os.sep)
        if len(parts) < 3 or parts[0] != "_src" or parts[1] not in FORBIDDEN_IMPORTS:
            continue
        for group in _imported_groups(text) & set(FORBIDDEN_IMPORTS[parts[1]]):
            wrong.append(f"{path} imports {group}")
    assert not wrong, wrong


def test_every_module_of_src_is_in_a_folder_that_says_what_it_holds():
    loose = []
    for path, _ in _modules():
        parts = path.split(os.sep)
        if parts[0] == "_src" and len(parts) == 2 and parts[1] != "__init__.py":
            loose.append(path)
    assert not loose, loose
    for folder in ("keras_internals", "precision", "optimizer", "model", "tools", "backends"):
        with open(os.path.join(PACKAGE, "_src", folder, "__init__.py")) as f:
            assert f.read().strip().startswith('"""'), folder
