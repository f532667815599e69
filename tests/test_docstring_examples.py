"""Every example in the library's docstrings written as a doctest (``>>>``) runs as written, given ``torch`` and
``capg_rec`` (a review found most of them stopping on a NameError); sketches of a user's loop are plain code."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import capg_rec

# capg_rec.torchrec needs TorchRec, which the test extra leaves out (it is installed on its own): without it, its
# modules' examples are not collected, and the rest still run.
try:
    import torchrec  # noqa: F401
    HAS_TORCHREC = True
except ImportError:
    HAS_TORCHREC = False
MODULES = sorted(info.name for info in pkgutil.walk_packages(capg_rec.__path__, "capg_rec.")
                 if HAS_TORCHREC or not info.name.startswith("capg_rec.torchrec"))


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module):  # in the module's namespace, as a reader of it is
            if test.examples:
                test.globs.update(torch=torch, capg_rec=capg_rec)
                tests.append(test)
    return tests


EXAMPLES = _examples()


def test_the_docstrings_hold_examples():  # the losses', EmbeddingCatalog's and the exact index's
    names = {t.name.rsplit(".", 1)[-1] for t in EXAMPLES}
    assert names >= {"VPGLoss", "CAPGLoss", "OffPolicyCAPGLoss", "EmbeddingCatalog", "ExactIndex"}, names


def test_modules_of_torchrec_are_left_out_only_without_it():
    assert any(name.startswith("capg_rec.torchrec") for name in MODULES) == HAS_TORCHREC


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_a_docstring_example_runs_as_written(test):
    torch.manual_seed(0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: None)
    assert runner.failures == 0, f"{test.name} ({test.filename}:{test.lineno}) fails as written"
