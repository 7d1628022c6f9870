"""scripts/gpu_mutants.py: each CUDA test named in MUTANTS exists, runs only where CUDA is, and reads its mutant's
name; and the runner itself, on a made-up test file run for real by pytest: a mutant counts as caught only when its
test fails, never when it passes or cannot run."""
import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("gpu_mutants", REPO / "scripts" / "gpu_mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_mutant_names_a_gpu_test_that_exists_and_reads_its_name():
    mutants = _mutants()
    assert mutants.MUTANTS and len({name for _, _, name in mutants.MUTANTS}) == len(mutants.MUTANTS)
    for defect, node, name in mutants.MUTANTS:
        file, test = node.split("::")
        assert file in mutants.CUDA_TESTS, node
        tests = {n.name: n for n in ast.walk(ast.parse((REPO / file).read_text())) if isinstance(n, ast.FunctionDef)}
        assert test in tests, node
        marks = [ast.unparse(d) for d in tests[test].decorator_list]
        assert any(m.startswith("needs_gpus(") for m in marks), (node, marks)  # it runs only where CUDA is
        if name in mutants.SOURCE_EDITS:  # put back in a copy of the repository: its line must be there once
            path, good, _ = mutants.SOURCE_EDITS[name]
            assert (REPO / path).read_text().count(good) == 1, (defect, path, good)
            continue
        asked = {c.args[0].value for c in ast.walk(tests[test]) if isinstance(c, ast.Call)
                 and getattr(c.func, "id", None) == "mutant" and c.args and isinstance(c.args[0], ast.Constant)}
        assert name in asked, (defect, node, asked)


TOY = '''
import os

import pytest


def add_one(x):
    return x + 1


@pytest.mark.gpu
def test_catches_its_defect():
    f = (lambda x: x) if os.environ.get("FIC_MUTANT") == "off-by-one" else add_one
    assert f(1) == 2


@pytest.mark.gpu
def test_blind():
    assert add_one(1) == 2
'''


def test_a_mutant_is_caught_only_when_its_test_fails(tmp_path, capsys):
    (tmp_path / "test_toy.py").write_text(TOY)
    mutants = _mutants()
    assert mutants.run(["test_toy.py"], [("a defect its test sees", "test_toy.py::test_catches_its_defect",
                                          "off-by-one")], cwd=tmp_path, timeout=120, cuda=True) == 0
    out = capsys.readouterr().out
    assert "as they are: passed" in out and "test_catches_its_defect fails" in out, out
    assert "1 of 1 defects caught" in out, out
    missed = [("a defect no test sees", "test_toy.py::test_blind", "off-by-one"),
              ("a test that is not there", "test_toy.py::test_gone", "off-by-one")]
    assert mutants.run(["test_toy.py"], missed, cwd=tmp_path, timeout=120, cuda=True) == 1
    out = capsys.readouterr().out
    assert "test_blind PASSES" in out and "test_gone ERROR" in out and "0 of 2 defects caught" in out, out


def test_without_cuda_nothing_is_put_back(tmp_path, capsys):
    (tmp_path / "test_toy.py").write_text(TOY.replace("@pytest.mark.gpu", "@pytest.mark.gpu\n@pytest.mark.skip"))
    mutants = _mutants()
    assert mutants.run(["test_toy.py"], mutants.MUTANTS, cwd=tmp_path, timeout=120, cuda=False) == 0
    assert "no CUDA: nothing to put back" in capsys.readouterr().out
