"""A newcomer's first mistakes with ``model-archiver`` (issue 47): every missing input reported in
one error, a misspelt handler function or built-in handler name caught at archiving (by reading
the file, never importing it) with "did you mean", and nothing written."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ArchiverRunner


def test_every_missing_input_in_one_error(archiver: ArchiverRunner, tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text("def handle(data, context):\n    return data\n")
    result = archiver(
        "--model-name", "m", "--version", "1", "--serialized-file", "out/m.pt",
        "--model-file", "examples/m/model.py", "--handler", "h.py:handle", "--export-path", "out",
    )  # fmt: skip
    assert result.exit_code == 3
    assert result.output.splitlines() == [
        "model-archiver: error: 3 problems with the inputs, nothing written:",
        "  - serialized file not found: out/m.pt; check the path",
        "  - model file not found: examples/m/model.py; check the path",
        "  - export path does not exist or is not a folder: out; create it first with mkdir -p,"
        " or pass another --export-path",
    ]
    assert not (tmp_path / "out").exists()


def test_a_misspelt_handler_function_is_caught_without_importing(
    archiver: ArchiverRunner, tmp_path: Path
) -> None:
    # importing would fail (and run code): the archiver reads the file instead
    (tmp_path / "h.py").write_text(
        "import not_installed_here\n\n\ndef handle(data, context):\n    return data\n"
    )
    result = archiver("--model-name", "m", "--handler", "h.py:handel", "--export-path", ".")
    assert result.exit_code == 2
    assert result.output == (
        "model-archiver: error: --handler 'h.py:handel': h.py has no function or class"
        " 'handel'; did you mean 'handle'?\n"
    )
    far = archiver("--model-name", "m", "--handler", "h.py:predict", "--export-path", ".")
    assert "has no function or class 'predict'; it defines handle" in far.output
    assert not (tmp_path / "m.mar").exists()
    ok = archiver("--model-name", "m", "--handler", "h.py:handle", "--export-path", ".", "-f")
    assert ok.exit_code == 0, ok.output
    # TorchServe serves a module's one class when the name is not found: left to the worker
    (tmp_path / "c.py").write_text("class Handler:\n    def handle(self, data, context):\n"
                                   "        return data\n")  # fmt: skip
    fallback = archiver("--model-name", "c", "--handler", "c.py:handle", "--export-path", ".")
    assert fallback.exit_code == 0, fallback.output


def test_a_handler_that_does_not_parse_is_named(archiver: ArchiverRunner, tmp_path: Path) -> None:
    (tmp_path / "h.py").write_text("def handle(data, context)\n    return data\n")
    result = archiver("--model-name", "m", "--handler", "h.py:handle", "--export-path", ".")
    assert result.exit_code == 2
    assert "h.py is not valid Python (line 1: expected ':')" in result.output


def test_a_misspelt_builtin_handler_gets_did_you_mean(archiver: ArchiverRunner) -> None:
    result = archiver("--model-name", "m", "--handler", "image_clasifier", "--export-path", ".")
    assert result.exit_code == 2
    assert result.output.startswith(
        "model-archiver: error: --handler 'image_clasifier': no built-in handler or file named"
        " 'image_clasifier'; did you mean 'image_classifier'?"
    )
    ok = archiver("--model-name", "m", "--handler", "image_classifier", "--export-path", ".")
    assert ok.exit_code == 0, ok.output
