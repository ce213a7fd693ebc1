"""The install takes the CPU build of torch on a machine without CUDA, never PyPI's CUDA build."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_a_machine_without_cuda_gets_the_cpu_build_of_torch():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "ops", "install_torch.py"), "--dry-run", "--cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = done.stdout.strip().splitlines()[-1]
    assert "pip would install torch 2.13.0" in verdict and verdict.endswith("the CPU build"), done.stdout
    assert "NVIDIA packages" not in verdict
