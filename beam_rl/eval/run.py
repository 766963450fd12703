"""`beam-rl eval`: AIME-style avg@k evaluation (sample -> grade -> report + JSONL).

    beam-rl eval --data math-ai/aime25 --server http://10.0.0.1:8000 --server http://10.0.0.2:8000
    beam-rl eval --data builtin --checkpoint ckpt/beam-tiny --max-tokens 64 --out runs/eval
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from beam_rl.errors import InputError
from beam_rl.eval.data import BUILTIN, Problem, load_problems
from beam_rl.eval.grading import GradingPool, normalize
from beam_rl.eval.metrics import format_report, score_problem, summarize
from beam_rl.eval.samplers import InProcessSampler, SamplingConfig, ServerSampler

# The DAPO-Math-17k prompt (BytedTsinghua-SIA/DAPO-Math-17k, the `prompt` field of every row).
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
TEMPLATES = {"dapo": DAPO_TEMPLATE, "raw": "{problem}"}


def resolve_template(template: str) -> str:
    """A template name (`dapo`, `raw`), a path to a text file, or a literal with `{problem}`."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if Path(template).is_file():
        template = Path(template).read_text()
    if "{problem}" not in template:
        raise ValueError(f"--template {template[:60]!r}: use 'dapo', 'raw', or text / a file containing {{problem}}")
    return template


def evaluate(problems: list[Problem], sampler, cfg: SamplingConfig, *, template: str = DAPO_TEMPLATE,
             pass_k: int | None = None, grade_workers: int = 2, grade_timeout_s: float = 10.0,
             out_dir: str | Path | None = None, progress: bool = True, title: str = "") -> dict:
    """Sample cfg.n responses per problem, grade them, and return {summary, scores, report};
    with `out_dir`, write responses.jsonl (every response with its grade), summary.json, report.txt."""
    from tqdm import tqdm

    k = pass_k or cfg.n
    prompts = [template.replace("{problem}", p.problem) for p in problems]
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=f"sampling {cfg.n}x", unit="problem", disable=not progress, file=sys.stderr)
    try:
        samples = sampler.sample(prompts, cfg, progress=bar)
    finally:
        bar.close()
    t_sample = time.perf_counter() - t0
    flat = [(i, s) for i, per in enumerate(samples) for s in per]
    with GradingPool(grade_workers, grade_timeout_s) as pool:
        grades = pool.grade([problems[i].answer for i, _ in flat], [s.text for _, s in flat])
    t_grade = time.perf_counter() - t0 - t_sample
    by_problem: dict[int, list[int]] = {}
    for j, (i, _) in enumerate(flat):
        by_problem.setdefault(i, []).append(j)
    scores = []
    for i, p in enumerate(problems):
        idx = by_problem.get(i, [])
        if len(idx) != cfg.n:
            raise RuntimeError(f"problem {p.id}: got {len(idx)} samples, asked for {cfg.n}")
        scores.append(score_problem(p.id, p.answer, [normalize(grades[j].extracted) for j in idx],
                                    [grades[j].correct for j in idx], k))
    summary = summarize(scores, [s.num_tokens for _, s in flat], [s.finish_reason == "length" for _, s in flat], k)
    report = format_report(summary, scores, title)
    report += f"\nsampling {t_sample:.1f} s, grading {t_grade:.1f} s ({sum(g.timed_out for g in grades)} grading timeouts)"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "responses.jsonl", "w") as f:
            for j, (i, s) in enumerate(flat):
                g = grades[j]
                f.write(json.dumps({"problem_id": problems[i].id, "sample": by_problem[i].index(j), "prompt": prompts[i],
                                    "response": s.text, "num_tokens": s.num_tokens, "finish_reason": s.finish_reason,
                                    "gold": problems[i].answer, "extracted": g.extracted, "correct": g.correct,
                                    "timed_out": g.timed_out, "grade_error": g.error}) + "\n")
        (out / "summary.json").write_text(json.dumps({"summary": asdict(summary), "sampling": asdict(cfg),
                                                      "problems": [asdict(s) for s in scores]}, indent=1))
        (out / "report.txt").write_text(report + "\n")
    return {"summary": summary, "scores": scores, "report": report}


def cmd_eval(args) -> int:
    problems = load_problems(args.data, split=args.split, problem_key=args.problem_key, answer_key=args.answer_key,
                             limit=args.limit)
    cfg = SamplingConfig(n=args.n, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    template = resolve_template(args.template)
    if bool(args.server) == bool(args.checkpoint):
        raise InputError("give either --server URL (repeatable) or --checkpoint DIR (in-process vLLM)")
    if args.server:
        sampler = ServerSampler(args.server, model=args.model, concurrency=args.concurrency)
        source = ", ".join(args.server)
    else:
        from beam_rl.engines import EngineSettings, start_rollout_engine
        from beam_rl.model.checkpoint import verify_checkpoint

        max_model_len = args.max_model_len or verify_checkpoint(args.checkpoint).max_position_embeddings
        engine = start_rollout_engine(EngineSettings(
            model=args.checkpoint, tokenizer=args.tokenizer or args.checkpoint, dtype=args.dtype, seed=args.seed,
            max_model_len=max_model_len, capture_routing=False, kv_cache_gib=args.kv_cache_gib,
            gpu_memory_utilization=args.gpu_memory_utilization))
        sampler = InProcessSampler(engine)
        source = args.checkpoint
    result = evaluate(problems, sampler, cfg, template=template, pass_k=args.pass_k, grade_workers=args.grade_workers,
                      grade_timeout_s=args.grade_timeout, out_dir=args.out, progress=not args.no_progress,
                      title=f"{args.data} on {source} (T={cfg.temperature}, top_p={cfg.top_p}, max_tokens={cfg.max_tokens}, seed={cfg.seed})")
    print(result["report"])
    if args.out:
        print(f"wrote {Path(args.out) / 'responses.jsonl'}, summary.json, report.txt")
    return 0


def add_eval_parser(sub) -> None:
    d = SamplingConfig()
    p = sub.add_parser("eval", help="AIME-style avg@k evaluation from vLLM servers or an in-process engine")
    p.add_argument("--data", default="math-ai/aime25",
                   help=f"hub dataset id (math-ai/aime25, opencompass/AIME2025), a .jsonl/.json/.parquet file, or '{BUILTIN}' (synthetic sample)")
    p.add_argument("--split", default=None, help="dataset split (default: the known split for the id, else 'test')")
    p.add_argument("--problem-key", default=None, help="problem column (default: first of problem/question/prompt/...)")
    p.add_argument("--answer-key", default=None, help="answer column (default: first of answer/ground_truth/...)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems")
    p.add_argument("--server", action="append", default=[], help="OpenAI-compatible vLLM server URL (repeat for several)")
    p.add_argument("--model", default=None, help="served model / LoRA name (default: the server's first model)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per server")
    p.add_argument("--checkpoint", default=None, help="run an in-process vLLM engine on this checkpoint instead")
    p.add_argument("--tokenizer", default=None, help="tokenizer for --checkpoint (default: the checkpoint's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None, help="engine context (default: the model's max_position_embeddings)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU engine: KV-cache memory in GiB (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU engine: vLLM's share of GPU memory (default 0.9)")
    p.add_argument("--n", type=int, default=d.n, help=f"samples per problem (default {d.n}: avg@8)")
    p.add_argument("--pass-k", type=int, default=None, help="k of pass@k (default: n)")
    p.add_argument("--temperature", type=float, default=d.temperature, help=f"default {d.temperature} (DAPO validation)")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"default {d.top_p} (DAPO's val_top_p)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"default {d.max_tokens} (DAPO: 1024 * 20)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--template", default="dapo", help="'dapo' (default), 'raw', or a text / file with {problem}")
    p.add_argument("--grade-workers", type=int, default=2, help="grading processes")
    p.add_argument("--grade-timeout", type=float, default=10.0, help="seconds per answer before it is graded wrong")
    p.add_argument("--out", default=None, help="directory for responses.jsonl, summary.json, report.txt")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)
