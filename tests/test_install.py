"""The install takes the CPU build of torch on a machine without CUDA, never PyPI's CUDA build, and a
plain `pip install pagedserve` serves: torch, no triton, no plotting or test tools, the C kernels
and the shipped model inside the wheel."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile

from tests.conftest import ROOT


def test_a_machine_without_cuda_gets_the_cpu_build_of_torch():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "ops", "install_torch.py"), "--dry-run", "--cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = done.stdout.strip().splitlines()[-1]
    assert "pip would install torch 2.13.0" in verdict and verdict.endswith("the CPU build"), done.stdout
    assert "NVIDIA packages" not in verdict


SERVING_ONLY_EXCLUDES = {"triton", "matplotlib", "pytest", "hypothesis", "openai", "jsonschema", "httpx"}


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower()


def test_a_plain_install_serves_with_torch_and_without_triton_plots_or_test_tools():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = {requirement_name(spec) for spec in project["dependencies"]}
    assert {"torch", "safetensors", "transformers", "pyzmq", "starlette"} <= names
    assert not names & SERVING_ONLY_EXCLUDES, names & SERVING_ONLY_EXCLUDES
    assert set(project["optional-dependencies"]) == {"cuda", "test", "bench"}


def test_the_wheel_carries_the_c_kernels_and_the_shipped_model(tmp_path):
    source = tmp_path / "source"
    for part in ("services", "shared", "kernels", "ops/models"):
        shutil.copytree(os.path.join(ROOT, part), source / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (tmp_path / "dist").glob("pagedserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "kernels", "*.c"))}
    assert {f"kernels/{k}" for k in kernels} <= names
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert f"ops/models/tiny-python/{name}" in names
    assert not any(n.startswith("tests/") or n.startswith("benchmarks/") for n in names)


def test_the_worker_gives_hf_greedy_tokens_with_triton_and_matplotlib_not_installed(tmp_path):
    for missing in ("triton", "matplotlib"):  # import fails as it does where neither is installed
        (tmp_path / missing).mkdir()
        (tmp_path / missing / "__init__.py").write_text(f"raise ModuleNotFoundError('no module named {missing}')\n")
    script = textwrap.dedent("""
        import importlib.util, sys, torch
        from transformers import AutoModelForCausalLM
        from services.launcher import SHIPPED_MODEL
        from tests.engine_harness import Engine
        prompt = [1, 5, 9, 13, 2, 40]
        [tokens] = Engine(SHIPPED_MODEL).generate([prompt], max_tokens=12)
        hf = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, torch_dtype=torch.float32)
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        print(tokens == expected[:len(tokens)] and len(tokens) > 0, "triton" in sys.modules and
              sys.modules["triton"] is not None)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr[-3000:]
