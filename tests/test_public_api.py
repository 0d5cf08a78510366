"""`import specdecode` gives the public API, lazily: the command line's start-up does not pay for torch."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

import specdecode


def test_the_public_names_are_the_library_objects():
    from specdecode.builder import build_generator
    from specdecode.serving.scheduler import build_scheduler
    from specdecode.engine import SpeculativeGenerator
    from specdecode.sequence import GenerationResult
    from specdecode.verification.sampling import SamplingParams

    assert specdecode.build_generator is build_generator and specdecode.build_scheduler is build_scheduler
    assert specdecode.SamplingParams is SamplingParams and specdecode.SpeculativeGenerator is SpeculativeGenerator
    assert specdecode.GenerationResult is GenerationResult
    assert specdecode.__version__ == version("specdecode")
    assert set(specdecode.__all__) == {"__version__", "build_generator", "build_scheduler", "SamplingParams",
                                       "SpeculativeGenerator", "GenerationResult"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        specdecode.nope


def test_importing_the_package_does_not_import_torch():
    code = "import sys, specdecode, specdecode.errors, specdecode.serving.limits; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_a_command_whose_extra_is_missing_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from specdecode import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert cli.main(["serve", "--target", "/nonexistent"]) != 0
    assert "pip install 'specdecode[serve]'" in capsys.readouterr().err
    assert cli.main(["bench", "--report", "--out", "/nonexistent"]) != 0
    assert "pip install 'specdecode[bench]'" in capsys.readouterr().err
