"""The paper-figure benchmarks run end to end at a tiny size and write well-formed results.

Shape only: speed is measured by running the scripts at full size, never by a test."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.fig12_latency_vs_rate import sustained_rate
from benchmarks.workloads import ALPACA_MEANS, SHAREGPT_MEANS, WORKLOADS, code, code_sources, describe
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


@pytest.mark.parametrize("name, means", [("sharegpt", SHAREGPT_MEANS), ("alpaca", ALPACA_MEANS)])
def test_traces_have_the_papers_mean_lengths_when_nothing_caps_them(name, means):
    trace = describe(WORKLOADS[name](4000, seed=1, max_model_len=1 << 20))
    assert trace["mean_input"] == pytest.approx(means[0], rel=0.1)
    assert trace["mean_output"] == pytest.approx(means[1], rel=0.1)


def test_capped_traces_fit_the_context_and_are_seeded():
    jobs = WORKLOADS["sharegpt"](500, seed=3, max_model_len=512)
    assert all(len(j.prompt) + j.output_len <= 512 for j in jobs)
    assert [j.prompt for j in WORKLOADS["sharegpt"](5, seed=3)] == [j.prompt for j in WORKLOADS["sharegpt"](5, seed=3)]
    prefixed = WORKLOADS["prefix5"](3, seed=0)
    assert prefixed[0].prompt[:341] == prefixed[1].prompt[:341] == prefixed[2].prompt[:341]


def test_code_prompts_come_from_a_fixed_commit_so_later_edits_change_none(tmp_path, capsys):
    source = "".join(f"value_{i} = compute({i})\n" for i in range(60))
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "module.py").write_text(source)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "sources"], check=True)
    revision = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "services" / "module.py").write_text(source.replace("compute", "changed"))

    pinned = code_sources(revision, tmp_path)
    assert pinned == (source,)
    prompts = [job.prompt for job in code(3, seed=5, sources=pinned)]
    assert prompts == [job.prompt for job in code(3, seed=5, sources=pinned)]
    assert all(p and "changed" not in p and p in source for p in prompts)
    assert code_sources("0" * 40, tmp_path)[0].count("changed") == 60  # no such commit: the tree, said aloud
    assert "cutting prompts from the working tree" in capsys.readouterr().err


def test_sustained_rate_is_where_latency_crosses_the_limit():
    assert sustained_rate([(1, 0.1), (2, 0.2), (3, 0.6)], 0.4) == pytest.approx(2.5)
    assert sustained_rate([(1, 0.1), (2, 0.2)], 0.4) == 2
    assert sustained_rate([(1, 0.5)], 0.4) == 0


def run_script(name, tmp_path, *flags):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", name), "--out-dir", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_figure_12_interleaves_systems_rate_by_rate_and_joins_systems_run_apart(tmp_path):
    common = [
        "--plot-dir",
        str(tmp_path),
        "--num-prompts",
        "3",
        "--rates",
        "2,8",
        "--num-blocks",
        "128",
        "--max-model-len",
        "192",
    ]
    out = run_script(
        "fig12_latency_vs_rate.py", tmp_path, *common, "--policies", "paged,oracle", "--interleave", "--tag", "_a"
    )
    lines = [line.split()[0] for line in out.splitlines() if "/s  normalized" in line]
    assert lines == ["pagedserve", "Orca", "pagedserve", "Orca"]  # rate by rate, not system by system
    run_script("fig12_latency_vs_rate.py", tmp_path, *common, "--policies", "max", "--tag", "_b")
    out = run_script(
        "fig12_latency_vs_rate.py",
        tmp_path,
        "--plot-dir",
        str(tmp_path),
        "--combine",
        str(tmp_path / "fig12_sharegpt_b.json"),
        str(tmp_path / "fig12_sharegpt_a.json"),
    )
    result = json.loads((tmp_path / "fig12_sharegpt.json").read_text())
    assert list(result["runs"]) == ["paged", "oracle", "max"] and (tmp_path / "fig12_sharegpt.png").stat().st_size > 0
    for runs in result["runs"].values():
        assert [r["rate"] for r in runs] == [2, 8]
        assert all(r["completed"] == 3 and r["failed"] == 0 and r["normalized_latency_s_per_token"] > 0 for r in runs)
    assert result["slo_s_per_token"] == pytest.approx(2 * result["runs"]["paged"][0]["normalized_latency_s_per_token"])
    assert set(result["sustained_rate"]) == {"paged", "oracle", "max"} and "sustained rate" in out


def test_figure_2_splits_used_kv_memory_and_reservation_wastes_it(tmp_path):
    run_script(
        "fig2_memory_breakdown.py",
        tmp_path,
        "--plot-dir",
        str(tmp_path),
        "--num-prompts",
        "12",
        "--policies",
        "paged,max",
        "--num-blocks",
        "128",
        "--max-model-len",
        "256",
    )
    breakdown = json.loads((tmp_path / "fig2_memory_breakdown.json").read_text())["breakdown_percent"]
    for shares in breakdown.values():
        assert shares["samples"] > 0
        assert shares["tokens"] + shares["reserved"] + shares["unused"] + shares["fragmented"] == pytest.approx(100.0)
    assert breakdown["paged"]["tokens"] > breakdown["max"]["tokens"]
    assert breakdown["paged"]["fragmented"] == 0.0
    # A paged request fills every slot it takes by its end; only a request between its last step
    # and its blocks' release can show as unused for a moment.
    assert breakdown["paged"]["unused"] < 1.0 < breakdown["max"]["unused"]


def test_hf_static_batching_baseline_reports_both_throughputs(tmp_path):
    out = run_script(
        "hf_static_batching.py", tmp_path, "--num-prompts", "4", "--batch-size", "2", "--max-model-len", "256"
    )
    result = json.loads((tmp_path / "hf_static_batching.json").read_text())
    assert result["pagedserve_output_tok_s"] > 0 and result["hf_generate_output_tok_s"] > 0
    assert result["useful_tokens"] == result["trace"]["mean_output"] * 4
    assert "pagedserve / HF generate" in out
