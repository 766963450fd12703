"""What the Q/K prefill "slow mode" is: the L2's dirty lines left by the benchmark's flush (H200 diagnosis).

Times `qk_norm_rope_ssmax_triton` (RoPE, Beam-1.0's heads, strided views of the packed projection,
outputs allocated per call as `bench_kernels.py` does) at 8 x 2048 tokens, each call alone between
CUDA events, after one of three states of the 50 MB L2, taken in turn:

  Z  a 256 MB buffer zeroed, as triton's do_bench flushes: the L2 is left full of dirty lines
  R  the same buffer read (summed): the same lines are evicted, and the L2 is left clean
  N  nothing: the previous call's output lines are still there, dirty

Eight passes, each with a fresh flush buffer (do_bench allocates one per call), the cache emptied
after every second. The summary counts the passes whose median exceeds 130 us; the kernel moves
454 MB, 116.5 us at 91% of the copy bandwidth. The ninth session (docs/benchmarks.md, "Ninth session
(2026-12-01): the Q/K slow mode is the flush's dirty L2") ran it as

    for i in 1 2 3 4; do python scripts/diag_qk_slow_mode.py; done | grep SUMMARY

and got, in each of the four processes, Z 8, R 0 and N 8 of 8: 142-250 us after Z, 116.4-116.9
after R, 189-290 after N (the campaign stage `bash scripts/h200_campaign.sh qk_slow_mode`).
"""
import os
import statistics

import torch

import bench_kernels as bk  # scripts/ is this script's directory, so the benchmark's helpers import

from beam_rl.model import numerics
from beam_rl.kernels import qk_norm_rope_ops

T = bk.PREFILL
SLOW_US = 130.0
REPS = 25
STATES = "ZRN"


def timed_after(state_prep, call) -> dict[str, list[float]]:
    """us of `call` after each state's preparation, REPS times, the states in turn."""
    times = {s: [] for s in STATES}
    for _ in range(REPS):
        for s in STATES:
            state_prep[s]()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times[s].append(start.elapsed_time(end) * 1e3)
    return times


def one_pass(call) -> dict[str, list[float]]:
    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")  # do_bench's size and dtype
    return timed_after({"Z": flush.zero_, "R": flush.sum, "N": lambda: None}, call)


def main():
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    torch.manual_seed(0)
    q, k, _, _, qw, kw, pos = bk._qkv(T)
    cos_sin = numerics.rope_cos_sin_cache(32768, bk.HEAD_DIM, 10000.0).to("cuda")

    def qk():
        return qk_norm_rope_ops.qk_norm_rope_ssmax_triton(q, k, qw, kw, pos, bk.EPS, cos_sin, None)

    slow = {s: 0 for s in STATES}
    passes = 8
    for p in range(passes):
        times = one_pass(qk)  # the flush buffer is freed on return
        med = {s: statistics.median(t) for s, t in times.items()}
        for s in STATES:
            slow[s] += med[s] > SLOW_US
        print(f"{conf} pass {p}: " + " ".join(f"{s} {med[s]:.1f} ({min(times[s]):.1f}-{max(times[s]):.1f})" for s in STATES)
              + " us", flush=True)
        if p % 2:
            torch.cuda.empty_cache()
    print(f"SUMMARY {conf}: passes with a median > {SLOW_US:.0f} us, of {passes}: "
          + " ".join(f"{s} {slow[s]}" for s in STATES), flush=True)


if __name__ == "__main__":
    main()
