"""`pagedserve up` supervises its three processes."""

import subprocess
import sys

from tests.conftest import ROOT, free_port, serve


def test_the_launcher_exits_non_zero_when_a_child_dies(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    cmd = [sys.executable, "-m", "services.launcher", "up", "--model", str(tmp_path),
           "--port", str(free_port()), "--device", "cpu", "--ready-timeout", "60"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    assert "exited" in done.stderr


def test_the_launcher_forwards_sigint_and_exits_cleanly(llama_dir, tmp_path):
    with serve(llama_dir, str(tmp_path)) as server:  # leaving the block sends SIGINT
        pass
    assert server.process.returncode == 0
