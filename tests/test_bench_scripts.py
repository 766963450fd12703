"""The GPU benchmark scripts' argument parsing (the benchmarks themselves run on the H200 only)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_rollout  # noqa: E402  (stdlib only at import; vLLM is imported inside the build's process)


def test_builds_with_environment_are_entries_of_their_own():
    builds = bench_rollout.parse_builds("fused,eager,fused:VLLM_ENABLE_V1_MULTIPROCESSING=1+OMP_NUM_THREADS=1")
    assert list(builds) == ["fused", "eager", "fused:VLLM_ENABLE_V1_MULTIPROCESSING=1+OMP_NUM_THREADS=1"]
    assert builds["fused"] == ("fused", {})
    assert builds["fused:VLLM_ENABLE_V1_MULTIPROCESSING=1+OMP_NUM_THREADS=1"] == (
        "fused", {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("spec, message", [
    ("fused,fast", "unknown build 'fast'"),
    ("fused,fused", "listed twice"),
    ("fused:OMP_NUM_THREADS", "expected BUILD:KEY=VALUE"),
    ("eager:=1", "expected BUILD:KEY=VALUE"),
])
def test_bad_builds_name_the_entry_and_the_fix(spec, message):
    with pytest.raises(SystemExit, match=message):
        bench_rollout.parse_builds(spec)
