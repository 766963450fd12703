"""scripts/h200_campaign.sh's detached mode on CPU: a campaign started with DETACH=1 outlives the call
that started it, and `--wait` returns its files and status once it has ended."""

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "h200_campaign.sh"


def _run(tmp_path: Path, out: str, *args: str, **env: str) -> str:
    environ = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / out), **env}
    done = subprocess.run(["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_detached_campaign_runs_on_past_its_call_and_wait_returns_its_files(tmp_path):
    # math_wait waits for a warm start that never comes: the stage runs until DETACH_BUDGET ends it
    started = _run(tmp_path, "call1", "math_wait", DETACH="1", DETACH_BUDGET="35", BUDGET="25")
    assert "detached campaign started" in started and "runs on (--wait again)" in started
    again = subprocess.run(["bash", str(SCRIPT), "math_wait"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "x"), "DETACH": "1"})
    assert again.returncode == 2 and "already runs" in again.stdout
    waited = _run(tmp_path, "call2", "--wait", BUDGET="60")
    assert "the detached campaign has ended" in waited
    assert "math_wait rc=124" in waited  # ended by its timeout, ~35 s after it started, not with the first call
    with tarfile.open(tmp_path / "call2" / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"status", "math_wait.log", "campaign.out", "campaign.sh"} <= names and ".done" not in names  # it ran from its copy


def test_wait_without_a_detached_campaign_says_so(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), "--wait"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "no detached campaign" in done.stdout


def test_math_wait_waits_for_one_dapo_engine_per_earlier_lane(tmp_path):
    """Lane k's math_wait passes once k DAPO logs show their engine started (the warm start's log does
    not count): with one such log, lane 1 passes and lane 2 waits until its stage's time ends."""
    warm = tmp_path / "work" / "ckpt" / "math-mini-warm"
    warm.mkdir(parents=True)
    (warm / "warm_start.json").write_text("{}")
    for out in ("one", "two"):
        (tmp_path / out).mkdir()
        (tmp_path / out / "math_bf16.log").write_text("rollout attention numerics: ...\n")
        (tmp_path / out / "math_warm.log").write_text("rollout attention numerics: ...\n")
    one = _run(tmp_path, "one", "bogus", "math_wait", BUDGET="60", PACK="0")
    assert "math_wait rc=0" in one
    two = _run(tmp_path, "two", "bogus", "bogus", "math_wait", BUDGET="45", PACK="0")
    assert "math_wait rc=124" in two
