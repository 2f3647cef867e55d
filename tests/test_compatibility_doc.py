"""docs/compatibility.md is the table in tests/compatibility.py, and names only real tests."""

import ast
from pathlib import Path

from compatibility import ROWS, render

TESTS = Path(__file__).parent


def test_doc_is_generated_from_the_table():
    doc = TESTS.parent / "docs" / "compatibility.md"
    assert doc.read_text() == render(), (
        "regenerate: python tests/compatibility.py > docs/compatibility.md"
    )


def test_every_named_test_exists():
    for composition, _, _, tests in ROWS:
        for test in tests:
            file, name = test.split("::")
            functions = {
                node.name
                for node in ast.walk(ast.parse((TESTS / file).read_text()))
                if isinstance(node, ast.FunctionDef)
            }
            assert name in functions, f"{composition}: {test} does not exist"
