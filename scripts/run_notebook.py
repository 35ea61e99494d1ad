"""Executes examples/quickstart.ipynb and stores it with its outputs.

GitHub shows a notebook as stored: run this after changing a cell, so that the
outputs and plots shown are those of the cells shown. It records a hash of the
code cells in the notebook's metadata; `tests/test_notebook.py` fails when the
cells no longer match it.

    pip install ".[test]"       # or ".[notebook]" plus nbclient and ipykernel
    python scripts/run_notebook.py
"""

import hashlib
import os
import re
import sys

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.ipynb")


def sources_hash(notebook):
    """The sha256 of the code cells' sources: what the stored outputs are of."""
    code = "\n\0\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    return hashlib.sha256(code.encode()).hexdigest()


# TensorFlow's C++ start-up lines, which its log level does not reach (the
# kernel's stderr while TensorFlow loads): not part of what the notebook shows.
NATIVE_LOG_LINE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\)"
    r"|[IWE]\d{4} [\d:.]+\s+\d+ \S+:\d+\]"
    r"|To enable the following instructions:)"
)


def drop_native_log_lines(notebook):
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            if output.get("name") == "stderr":
                lines = [line for line in output.text.splitlines() if line.strip()]
                if all(NATIVE_LOG_LINE.match(line) for line in lines):
                    continue
            kept.append(output)
        cell.outputs = kept


def main():
    import nbclient
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["KERAS_BACKEND"] = "tensorflow"  # the backend the notebook is shown with
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},
    ).execute()
    drop_native_log_lines(notebook)
    notebook.metadata["keras_mp"] = {"sources_sha256": sources_hash(notebook)}
    nbformat.write(notebook, NOTEBOOK)
    print(f"executed and stored: {os.path.normpath(NOTEBOOK)}", file=sys.stderr)


if __name__ == "__main__":
    main()
