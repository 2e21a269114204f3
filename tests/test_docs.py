"""The docs say what the code does: the README's API block lists every
argument, and every test a how-to page names as its proof exists."""

from __future__ import annotations

import inspect
import os
import re

import pytest
from conftest import TESTS_DIR, run_once_on

import keras_ft

ROOT = os.path.dirname(TESTS_DIR)
ONCE = run_once_on("torch", "text; the backend does not matter")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


@ONCE
def test_the_readme_api_block_names_every_argument_in_order():
    readme = read("README.md")
    block = readme[readme.index("keras_ft.BackupAndRestore(\n") :]
    block = block[: block.index("```")]
    listed = re.findall(r"^    (\w+)[=,]", block, re.M)
    parameters = list(inspect.signature(keras_ft.BackupAndRestore).parameters)
    assert listed == parameters


@ONCE
def test_the_readme_stays_short():
    assert len(read("README.md").splitlines()) <= 200


@ONCE
@pytest.mark.parametrize(
    "page",
    ["docs/cluster.md", "docs/tuner.md", "docs/notebook.md", "docs/buckets.md",
     "docs/lora.md"],
)  # fmt: skip
def test_every_test_a_page_names_exists(page):
    named = re.findall(r"`(tests/test_\w+\.py)(?:::(\w+))?`", read(page))
    assert named
    for path, test in named:
        assert os.path.exists(os.path.join(ROOT, path)), path
        if test:
            assert re.search(rf"^def {test}\(", read(path), re.M), f"{path}::{test}"


@ONCE
def test_every_example_a_page_names_exists():
    pages = ("README.md", "docs/cluster.md", "docs/tuner.md", "docs/lora.md")
    for page in pages:
        for path in re.findall(r"(examples/[\w.]+\.(?:py|sh))", read(page)):
            assert os.path.exists(os.path.join(ROOT, path)), f"{page}: {path}"
