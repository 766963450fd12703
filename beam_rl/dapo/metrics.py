"""Per-step metrics: `RUN_DIR/metrics.jsonl` (one JSON object per step) and TensorBoard (`RUN_DIR/tb`)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def _after_earlier_event_files(tb_dir: Path) -> None:
    """Wait, if needed, until an event file created now sorts after those in `tb_dir`. TensorBoard
    reads a directory's files in name order and purges on resume only from later files; names are
    `events.out.tfevents.<10-digit second>.<host>.<pid>.<writer count>`, and within one second and
    process a 10th writer's name sorts before the 9th's (".10" < ".9"): its steps would be the
    ones purged (seen in one pytest process)."""
    stamps = [p.name.split(".")[3] for p in tb_dir.glob("events.out.tfevents.*")]
    seconds = [int(s) for s in stamps if s.isdigit()]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(0.05)


class MetricsWriter:
    def __init__(self, run_dir: Path, *, resume_step: int | None = None, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:  # drop steps after the checkpoint: they are recomputed identically
            kept = [line for line in read_metrics(self.path) if line["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # on resume, drop the events after the checkpoint: the steps are recomputed and written again
                purge = None if resume_step is None else resume_step + 1
                if purge is not None:
                    _after_earlier_event_files(Path(run_dir) / "tb")
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=purge)
            except ImportError:  # tensorboard not installed: jsonl only
                self.tb = None

    def write(self, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, metrics["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


# torch.compile's own timers: Dynamo's frame compiles (Inductor's forward kernels included) and the
# backward graphs that AOTAutograd compiles at their first backward
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def torch_compile_seconds() -> float:
    """Seconds this process has spent compiling with torch.compile so far (a step's `compile_s` is
    the difference across its train phase: the trainer's kernels meeting a shape they were not
    compiled for)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS))


def cuda_memory_peaks() -> dict:
    """This process's GPU memory peaks since the last call (which resets them), GiB:
    `gpu_peak_allocated_gib`, the most its tensors held (the in-process engine's KV cache and weights
    included), and `gpu_peak_reserved_gib`, the most PyTorch's caching allocator held from the GPU
    (the difference: cached free blocks). The CUDA context and what is allocated outside PyTorch's
    allocator (NCCL buffers, vLLM's sleep-mode pool) are in neither: nvidia-smi reads more. Empty when
    this process has not used CUDA. What decides how many runs share a GPU."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    peaks = {"gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
             "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}
    torch.cuda.reset_peak_memory_stats()
    return peaks


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
