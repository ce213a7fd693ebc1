"""The scheduler and the api never import torch: they must run on machines without it."""

import ast
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_FREE = ["services/scheduler", "services/api", "shared"]


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _needs_torch(module: str) -> bool:
    return module.split(".")[0] in ("torch", "triton", "kernels") or module.startswith("services.worker")


def test_no_module_of_the_scheduler_or_api_imports_torch():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in TORCH_FREE
        for path in (ROOT / folder).rglob("*.py")
        if any(_needs_torch(name) for name in _imports(path))
    ]
    assert offenders == []


def test_loading_the_scheduler_and_api_leaves_torch_unloaded():
    code = (
        "import sys; import services.scheduler.server, services.scheduler.__main__, "
        "services.api.app, services.launcher; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_api_loads_its_tokenizer_with_torch_installed_but_never_imported(llama_dir):
    code = (
        "import sys; from services.api.__main__ import _tokenizers_only; _tokenizers_only(); "
        "from transformers import AutoTokenizer; "
        f"t = AutoTokenizer.from_pretrained({llama_dir!r}, local_files_only=True); "
        "ids = t.encode('def main():'); "
        "chat = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False); "
        "print(sys.modules.get('torch') is None, t.decode(ids, skip_special_tokens=True) == 'def main():', "
        "'hi' in chat)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stdout + out.stderr
    assert "PyTorch was not found" not in out.stderr
