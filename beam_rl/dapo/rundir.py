"""Run directories that never lose results silently.

- `RUN_DIR/run.json` names the run (`run_id`, the recipe); every checkpoint carries the same id.
- A fresh start refuses a directory holding an earlier run unless told: `--resume` continues it,
  `--overwrite` removes its results (only the entries a run writes) first.
- `--resume` continues from the newest checkpoint that belongs to this run and passes its checksums
  (`checkpointing.latest`); metrics.jsonl must reach that checkpoint's step.
- Leftovers of killed runs are removed at start: atomic-write temp directories in the run
  directory and `/dev/shm/beam-rl-*` weight copies whose owning process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from beam_rl.dapo.config import RecipeError

RUN_FILE = "run.json"
# What a run writes into its directory; `--overwrite` removes these and nothing else.
RUN_ENTRIES = (RUN_FILE, "metrics.jsonl", "checkpoints", "tb", "engine", "plots")  # engine.log appends
SHM_PREFIX = "beam-rl-"
OWNER_FILE = "owner.json"


def earlier_results(run_dir: Path) -> list[str]:
    """The entries of an earlier run that `run_dir` holds (empty: nothing to lose)."""
    run_dir = Path(run_dir)
    found = []
    for name in RUN_ENTRIES:
        p = run_dir / name
        if p.is_file() and p.stat().st_size > 0 or p.is_dir() and any(p.iterdir()):
            found.append(name)
    return found


def start_fresh(run_dir: Path, *, overwrite: bool, recipe_dict: dict) -> str:
    """Claim `run_dir` for a new run; returns its run id. Refuses a directory with earlier results
    unless `overwrite`, which removes them."""
    run_dir = Path(run_dir)
    found = earlier_results(run_dir)
    if found and not overwrite:
        raise RecipeError(f"run directory {run_dir} holds an earlier run ({', '.join(found)}); pass --resume to continue it "
                          "or --overwrite to replace it (or choose another --out)")
    for name in found:
        p = run_dir / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    _write_json(run_dir / RUN_FILE, {"run_id": run_id, "recipe": recipe_dict})
    return run_id


def run_id_of(run_dir: Path) -> str | None:
    p = Path(run_dir) / RUN_FILE
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())["run_id"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise RecipeError(f"{p} is damaged; it names the run that {Path(run_dir)} holds. Restore it, or start over "
                          "with --overwrite") from None


# Recipe keys a resumed run may change: how long it runs and how often it saves and evaluates.
RESUMABLE_CHANGES = ("run.total_steps", "run.checkpoint_every", "run.eval_every", "run.out", "run.max_mean_abs_logprob_diff")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def check_same_recipe(run_dir: Path, recipe_dict: dict) -> None:
    """A resumed run must be the same run: its recipe may differ from the saved one only in
    `RESUMABLE_CHANGES`."""
    saved = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("recipe") or {}
    old, new = _flat(json.loads(json.dumps(saved, default=str))), _flat(json.loads(json.dumps(recipe_dict, default=str)))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise RecipeError(f"--resume: the recipe differs from the run's in {changed[:5]} (saved in {Path(run_dir) / RUN_FILE}); "
                          "only " + ", ".join(RESUMABLE_CHANGES) + " may change on resume; start a new run with --out or --overwrite")


def check_metrics_reach(run_dir: Path, step: int) -> None:
    """metrics.jsonl must hold every step up to the checkpoint `step` (else the resumed run's record
    would have a hole)."""
    from beam_rl.dapo.metrics import read_metrics

    steps = {int(m["step"]) for m in read_metrics(Path(run_dir))}
    missing = [s for s in range(step + 1) if s not in steps and s > 0]
    if missing:
        raise RecipeError(f"{Path(run_dir) / 'metrics.jsonl'} lacks step(s) {missing[:5]} before the checkpoint at step {step}; "
                          "it does not belong to this run's checkpoints. Restore it, or start over with --overwrite")


def finished(run_dir: Path, total_steps: int) -> bool:
    """Whether the run in `run_dir` has recorded its step `total_steps` (metrics.jsonl): a `--resume`
    then has nothing to do, with or without checkpoints left (a run's last checkpoint may have been
    removed to free the disk, and resuming from none would start the run over)."""
    from beam_rl.dapo.metrics import read_metrics

    return (Path(run_dir) / RUN_FILE).exists() and any(int(m["step"]) >= total_steps for m in read_metrics(Path(run_dir)))


def clean_leftovers(run_dir: Path) -> list[Path]:
    """Remove temp directories of interrupted atomic writes under `run_dir` and `/dev/shm` weight
    copies of runs whose process no longer exists; returns what was removed."""
    removed = []
    for parent in (Path(run_dir), Path(run_dir) / "checkpoints", Path(run_dir) / "engine"):
        if parent.is_dir():
            for p in parent.iterdir():
                if p.is_dir() and p.name.startswith(".") and ".tmp-" in p.name:
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
    shm = Path("/dev/shm")
    if shm.is_dir():
        for p in shm.glob(SHM_PREFIX + "*"):
            owner = p / OWNER_FILE
            try:
                pid = int(json.loads(owner.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not ours, or still being created
            if not _alive(pid):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def claim_shm_dir(path: Path, run_dir: Path) -> None:
    """Mark a /dev/shm weight copy as this process's, so a later run can tell it is stale."""
    _write_json(Path(path) / OWNER_FILE, {"pid": os.getpid(), "run_dir": str(Path(run_dir).resolve())})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
