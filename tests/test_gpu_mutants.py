"""scripts/gpu_mutants.py puts each GPU defect back by replacing one line: each line must still be in the template
exactly once, and each named test must exist, or the GPU check would report a defect it never put back."""
import ast
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("gpu_mutants", REPO / "scripts" / "gpu_mutants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_defect_replaces_one_line_of_the_template_and_names_a_gpu_test_that_exists():
    mutants = _mutants()
    assert mutants.DEFECTS
    for defect, path, good, bad, test in mutants.DEFECTS:
        text = (REPO / path).read_text()
        assert text.count(good) == 1, (defect, good)
        ast.parse(text.replace(good, bad))  # the copy with the defect still imports
        file, name = test.split("::")
        tests = {n.name: n for n in ast.walk(ast.parse((REPO / file).read_text())) if isinstance(n, ast.FunctionDef)}
        assert name in tests, test
        marks = [ast.unparse(d) for d in tests[name].decorator_list]
        assert any(m.startswith("needs_gpus(") for m in marks), (test, marks)  # it runs only where CUDA is
