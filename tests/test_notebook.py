"""The quickstart notebook in a real Jupyter kernel: killed, restarted, resumed."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import keras
import nbformat
import pytest
from conftest import backup_deleted, subprocess_env
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

import keras_ft

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="a kernel per run is slow; the notebook's backend does not matter: once",
)

NOTEBOOK = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "notebooks", "quickstart.ipynb",
)  # fmt: skip
STEPS = 10 * 8192 // 32  # EPOCHS * batches per epoch, as in the notebook.


def client(tmp_path) -> NotebookClient:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    return NotebookClient(
        notebook, timeout=300, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )  # fmt: skip


def kernel_env(tmp_path) -> dict[str, str]:
    env = subprocess_env()
    env["KERAS_FT_QUICKSTART_DIR"] = str(tmp_path / "backup")
    return env


def outputs(notebook) -> tuple[str, list[dict]]:
    """The text every cell printed, and the error outputs."""
    text, errors = [], []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                errors.append(output)
            elif output.get("output_type") == "stream":
                text.append(output["text"])
            elif "data" in output and "text/plain" in output["data"]:
                text.append(output["data"]["text/plain"])
    return "".join(text), errors


def committed(backup_dir: str) -> list[keras_ft.Checkpoint]:
    return list(keras_ft.watch(backup_dir, timeout=0))


def run_in_thread(target) -> tuple[threading.Thread, list]:
    raised = []

    def run():
        try:
            target()
        except BaseException as e:  # noqa: BLE001  Looked at by the test.
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


def wait_for_commit(backup_dir: str, thread: threading.Thread, raised: list) -> None:
    deadline = time.monotonic() + 240
    while not committed(backup_dir):
        assert thread.is_alive(), (
            f"the notebook ended before its first backup: {raised}"
        )
        assert time.monotonic() < deadline, "no backup within 240 s"
        time.sleep(0.05)


def test_a_killed_kernel_resumes_at_the_saved_step(tmp_path):
    backup_dir = str(tmp_path / "backup")
    first = client(tmp_path)
    thread, raised = run_in_thread(lambda: first.execute(env=kernel_env(tmp_path)))
    while first.km is None or not first.km.has_kernel:
        time.sleep(0.05)
    wait_for_commit(backup_dir, thread, raised)
    # As the out-of-memory killer would: SIGKILL, mid-epoch.
    first.km.provisioner.process.send_signal(signal.SIGKILL)
    thread.join(timeout=120)
    assert raised and isinstance(raised[0], (DeadKernelError, RuntimeError)), raised
    saved = committed(backup_dir)[-1].step
    assert 0 < saved < STEPS

    second = client(tmp_path)  # A new kernel, the notebook run again.
    second.execute(env=kernel_env(tmp_path))
    text, errors = outputs(second.nb)
    assert errors == []
    assert "Traceback" not in text and "Error" not in text
    restored = re.search(r"BackupAndRestore: restored .*optimizer step (\d+)", text)
    assert restored, text
    assert int(restored.group(1)) == saved  # Not epoch 0: the saved step.
    assert f"optimizer steps: {STEPS} " in text  # As an uninterrupted run.
    assert backup_deleted(backup_dir)  # Finished: deleted.


def test_interrupt_ends_the_cell_and_running_it_again_continues(tmp_path):
    backup_dir = str(tmp_path / "backup")
    notebook = client(tmp_path)
    fit_cell = next(
        i for i, c in enumerate(notebook.nb.cells) if "model.fit(" in c.source
    )
    with notebook.setup_kernel(env=kernel_env(tmp_path)):
        for index in range(fit_cell):
            notebook.execute_cell(notebook.nb.cells[index], index)
        cell = notebook.nb.cells[fit_cell]
        thread, raised = run_in_thread(lambda: notebook.execute_cell(cell, fit_cell))
        wait_for_commit(backup_dir, thread, raised)
        # The "Interrupt kernel" button: SIGINT to the kernel process.
        notebook.km.provisioner.process.send_signal(signal.SIGINT)
        thread.join(timeout=120)
        assert raised and isinstance(raised[0], CellExecutionError), raised
        error = [o for o in cell.outputs if o.output_type == "error"]
        assert [o.ename for o in error] == ["KeyboardInterrupt"]
        assert "run the cell again to continue" in error[0].evalue
        text, _ = outputs(notebook.nb)
        assert "run the cell again to resume at this step" in text
        assert "SystemExit" not in text and "To exit: use" not in text
        saved = committed(backup_dir)[-1].step

        # Run the cell again, in the same kernel: it goes on from the backup.
        notebook.execute_cell(cell, fit_cell)
        notebook.execute_cell(notebook.nb.cells[fit_cell + 1], fit_cell + 1)
        text, errors = outputs(notebook.nb)
        assert not [o for o in cell.outputs if o.output_type == "error"]
        restored = re.search(r"BackupAndRestore: restored .*optimizer step (\d+)", text)
        assert restored and int(restored.group(1)) == saved, text
        assert f"optimizer steps: {STEPS} " in text

        # And the whole notebook once more in this kernel: trains anew, fine.
        for index, again in enumerate(notebook.nb.cells):
            notebook.execute_cell(again, index)
        text, errors = outputs(notebook.nb)
        assert errors == [] and f"optimizer steps: {STEPS} " in text
