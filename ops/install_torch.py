"""Install torch into the running Python's environment: the CPU build on a machine without CUDA,
the CUDA build on a machine with it.

PyPI's torch for Linux x86_64 is the CUDA build (several GB with its NVIDIA packages), so on a
machine without an NVIDIA driver the wheel comes from the PyTorch project's CPU index, when that
is reachable; otherwise pip takes what its own configuration finds (a local wheel folder, say),
and this says so. `--dry-run` installs nothing: it prints what pip would take, from pip's
installation report, and exits non-zero if a CPU machine would get a CUDA build.

    python ops/install_torch.py [--dry-run] [--cuda | --cpu]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request

TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_cuda() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/torch/", timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


def pip_arguments(cuda: bool) -> tuple[list[str], str]:
    """pip's arguments, and where the wheel comes from, in words."""
    if cuda:
        return [TORCH], "PyPI (the CUDA build)"
    if reachable(CPU_INDEX):
        # torch's own dependencies (sympy, filelock, ...) still come from PyPI.
        return [TORCH, "--index-url", CPU_INDEX, "--extra-index-url", "https://pypi.org/simple"], CPU_INDEX
    return [TORCH], "pip's configured indexes and wheel folders (the PyTorch CPU index is not reachable)"


def dry_run(arguments: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        report = f"{directory}/report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "-q",
                "--report",
                report,
                *arguments,
            ],
            check=True,
        )
        with open(report) as f:
            return json.load(f)


def summarize(report: dict) -> tuple[str, bool]:
    """The torch wheel pip picked, and whether it is a CUDA build."""
    names = {item["metadata"]["name"].lower(): item for item in report["install"]}
    torch = names["torch"]
    version, url = torch["metadata"]["version"], torch["download_info"]["url"]
    cuda_packages = sorted(name for name in names if name.startswith("nvidia-"))
    is_cuda = bool(cuda_packages) or "+cu" in version
    described = f"torch {version} from {url}"
    if cuda_packages:
        described += f" with {len(cuda_packages)} NVIDIA packages ({', '.join(cuda_packages[:3])}, ...)"
    return described, is_cuda


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="show what pip would install, install nothing")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--cuda", action="store_true", help="the CUDA build, whatever this machine has")
    choice.add_argument("--cpu", action="store_true", help="the CPU build, whatever this machine has")
    args = parser.parse_args()
    cuda = args.cuda or (not args.cpu and has_cuda())
    arguments, source = pip_arguments(cuda)
    print(f"install_torch: {'CUDA' if cuda else 'no CUDA'} here; {TORCH} from {source}", flush=True)
    if args.dry_run:
        described, is_cuda = summarize(dry_run(arguments))
        print(f"install_torch: pip would install {described}: the {'CUDA' if is_cuda else 'CPU'} build")
        return 1 if is_cuda and not cuda else 0
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", *arguments]).returncode


if __name__ == "__main__":
    sys.exit(main())
