"""Count how often the Q/K prefill kernels run in the slow mode in one fresh process (H200 diagnosis).

Times `qk_norm_rope_ssmax_triton` at 8 x 2048 tokens with Beam-1.0's heads, as `bench_kernels.py`
does (do_bench; outputs allocated per call): RoPE and SSMax on strided views of the packed
projection, then RoPE on fresh contiguous inputs and on a fresh packed input, six passes (the cache
emptied after every second). The summary line counts the timings above 130 us; the fast mode takes
120-122 us on the H200. The eighth session (docs/benchmarks.md, "The Q/K slow mode") ran it as

    for i in 1 2 3; do
      python scripts/diag_qk_slow_mode.py
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/diag_qk_slow_mode.py
    done | grep SUMMARY

and got 0, 22 and 16 of 24 slow with the default allocator, 0, 0 and 3 with expandable segments
(the same loop is the campaign stage `bash scripts/h200_campaign.sh qk_slow_mode`).
"""
import os

import torch

import bench_kernels as bk  # scripts/ is this script's directory, so the benchmark's helpers import

from beam_rl import numerics
from beam_rl.kernels import qk_norm_rope_ops

T = bk.PREFILL
SLOW_US = 130.0


def main():
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    torch.manual_seed(0)
    q, k, v, g, qw, kw, pos = bk._qkv(T)
    cs = numerics.rope_cos_sin_cache(32768, bk.HEAD_DIM, 10000.0).to("cuda")
    ss = numerics.ssmax_scale_cache(32768).to("cuda")

    def qk(qq, kk, rope=True):
        return qk_norm_rope_ops.qk_norm_rope_ssmax_triton(qq, kk, qw, kw, pos, bk.EPS, cs if rope else None,
                                                          None if rope else ss)

    def on_fresh_inputs(make):  # RoPE on inputs allocated for this timing only (freed on return)
        qq, kk = make()
        return bk.bench(lambda: qk(qq, kk))

    times = []
    for rnd in range(6):
        row = [bk.bench(lambda: qk(q, k)), bk.bench(lambda: qk(q, k, rope=False)),
               on_fresh_inputs(lambda: (q.contiguous(), k.contiguous())), on_fresh_inputs(lambda: bk._qkv(T)[:2])]
        if rnd % 2:
            torch.cuda.empty_cache()
        times += row
        print(f"{conf}: pass {rnd}: rope {row[0]:.1f} ssmax {row[1]:.1f} contiguous-in {row[2]:.1f} "
              f"fresh-in {row[3]:.1f}", flush=True)
    slow = sum(t > SLOW_US for t in times)
    print(f"SUMMARY {conf}: {slow} of {len(times)} timings > {SLOW_US:.0f} us; min {min(times):.1f} "
          f"max {max(times):.1f}", flush=True)


if __name__ == "__main__":
    main()
