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
import zipfile
from pathlib import Path

import pytest
import tomllib

from kernels import native
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def test_a_machine_without_cuda_gets_the_cpu_build_of_torch():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "ops", "install_torch.py"), "--dry-run", "--cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    assert set(project["optional-dependencies"]) == {"cuda", "test", "bench", "dev"}  # dev: lint, types, docs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of the tree's packaged parts."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    for part in ("services", "shared", "kernels", "ops/models"):
        shutil.copytree(
            os.path.join(ROOT, part), source / part, ignore=shutil.ignore_patterns("__pycache__", "prebuilt")
        )
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [built_wheel] = (tmp_path / "dist").glob("pagedserve-*.whl")
    return built_wheel


def test_the_wheel_carries_the_c_kernels_prebuilt_and_the_shipped_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {os.path.basename(p)[:-2] for p in glob.glob(os.path.join(ROOT, "kernels", "*.c"))}
    assert {f"kernels/{k}.c" for k in kernels} <= names
    assert {f"kernels/prebuilt/{k}-{variant}.so" for k in kernels for variant in native.VARIANTS} <= names  # x86-64
    assert {"kernels/prebuilt/cpu_norm-portable.so", "kernels/prebuilt/cpu_attention-portable.so"} <= names
    assert "-linux_x86_64" in wheel.name  # a platform wheel: it holds compiled code
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert f"ops/models/tiny-python/{name}" in names
    assert not any(n.startswith("tests/") or n.startswith("benchmarks/") for n in names)


def test_the_installed_package_runs_its_prebuilt_kernels_with_no_compiler_on_path(wheel, tmp_path):
    target, cache = tmp_path / "site", tmp_path / "cache"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    script = textwrap.dedent("""
        import shutil, torch
        from kernels import native
        from kernels.cpu_norm import rms_norm
        assert shutil.which("cc") is None and shutil.which("gcc") is None
        loaded = {name: native.load(name)._name for name in ("cpu_norm", "cpu_gemm", "cpu_attention", "rotary_write")}
        x, weight = torch.randn(5, 64), torch.randn(64)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        assert torch.allclose(rms_norm(x, weight, 1e-5), expected, atol=1e-5)
        print(sorted(loaded.values()))
    """)
    libraries = [p for p in sys.path if p and os.path.abspath(p) != ROOT]  # torch and the rest, not this tree
    env = {
        "PATH": "/nonexistent",
        "PYTHONPATH": os.pathsep.join([str(target), *libraries]),
        "XDG_CACHE_HOME": str(cache),
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    loaded = done.stdout.strip().splitlines()[-1]
    libraries = re.findall(r"'([^']+)'", loaded)
    best = native.best_variant()  # the best build this CPU runs, chosen at run time
    assert len(libraries) == 4 and all(
        path.startswith(str(target / "kernels" / "prebuilt")) and path.endswith(f"-{best}.so") for path in libraries
    ), libraries
    assert not any(cache.rglob("*.so"))  # nothing compiled


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
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr[-3000:]
