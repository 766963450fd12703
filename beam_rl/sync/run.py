"""`beam-rl sync`: push new weights into running vLLM servers, all or nothing.

    beam-rl sync --server http://127.0.0.1:8000 --server http://127.0.0.1:8001 \\
        --hf ckpt/step-200 --previous ckpt/step-100
    beam-rl sync --server ... --megatron megatron-ckpt/ --staging runs/sync/step-200 --previous ckpt/step-100
    beam-rl sync --server ... --lora adapters/step-200 --lora-name policy
    beam-rl sync --server ... --hf ckpt/step-200 --previous ckpt/step-100 --strategy nccl --master-address 10.0.0.5
    beam-rl sync --server ... --hf ckpt/step-200 --serve mxfp8 --staging runs/sync/step-200 --previous runs/sync/step-100

`--serve mxfp8` (an MXFP8 run): the servers load a copy of the checkpoint whose quantised linears'
weights are quantised and dequantised as the trainer computes with them; checkpoints keep the
unquantised weights, so the copy is written to `--staging`.

Protocol: check every server, and a full update's tensors (names, shapes, dtypes) against each
server's model -> pause every server -> apply + verify on every server (in parallel) -> resume
every server. If any server fails anywhere, each touched server's state is asked of the server on
new connections (never inferred from the failed request's connection): a reachable one is rolled
back to `--previous` (verified by checksums too) before any resumes; one whose rollback fails stays
paused (never serving a mix) and is named, and so is one that cannot be reached (its state is
unknown). The command then exits 1. `--previous` is the directory the servers serve now: the caller
says it, because a reloaded server cannot tell which directory its weights came from.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from beam_rl.errors import InputError
from beam_rl.sync.base import ServerClient, ServerReport, SyncError, WeightUpdate, check_manifest, get_strategy


@dataclass
class SyncResult:
    ok: bool
    reports: list[ServerReport] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # url -> why it failed
    rolled_back: list[str] = field(default_factory=list)
    left_paused: dict[str, str] = field(default_factory=dict)  # url -> why its rollback failed
    unreachable: list[str] = field(default_factory=list)  # touched servers that no longer answer: state unknown

    def describe(self) -> str:
        lines = []
        for r in self.reports:
            lines.append(f"  {r.url}: {r.nbytes / 1e6:.2f} MB in {r.seconds:.3f} s = {r.gb_per_s:.3f} GB/s")
        if self.ok:
            return "sync ok on every server:\n" + "\n".join(lines)
        lines = [f"sync FAILED on {url}: {why.removeprefix(url + ': ')}" for url, why in self.errors.items()]
        if self.rolled_back:
            lines.append("rolled back to the previous weights (verified) and resumed: " + ", ".join(self.rolled_back))
        for url, why in self.left_paused.items():
            lines.append(f"LEFT PAUSED (rollback failed, not serving): {url}: {why.removeprefix(url + ': ')}")
        for url in self.unreachable:
            lines.append(f"UNREACHABLE after the failure, not rolled back (dead, or paused with partly loaded weights): {url}")
        return "\n".join(lines)


def _parallel(fn, servers: list[ServerClient]) -> dict[str, object]:
    """Run fn(server) on every server concurrently; url -> result or the exception raised."""
    def call(s):
        try:
            return fn(s)
        except Exception as e:  # noqa: BLE001  (every failure is reported per server)
            return e if isinstance(e, SyncError) else SyncError(f"{s.url}: {type(e).__name__}: {e}")

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        return dict(zip([s.url for s in servers], pool.map(call, servers)))


def sync_servers(urls: list[str], update: WeightUpdate, previous: WeightUpdate | Callable[[ServerClient], WeightUpdate],
                 *, strategy: str = "disk", strategy_options: dict | None = None, pause_mode: str = "wait",
                 timeout_s: float = 600.0, before_apply: Callable[[ServerClient], None] | None = None) -> SyncResult:
    """Apply `update` on every server or on none. `previous`: what the servers serve now (or a
    function of the server giving it), the rollback target. `strategy_options`: keyword arguments
    of the strategy (e.g. `master_address` for nccl / gloo). `before_apply(server)` runs in each
    server's thread just before its update (a hook for fault-injection tests)."""
    if not urls:
        raise InputError("give at least one --server URL")
    strat = get_strategy(strategy, **(strategy_options or {}))
    servers = [ServerClient(u, timeout_s) for u in urls]
    result = SyncResult(ok=False)
    try:
        checked = _parallel(lambda s: s.check(), servers)
        if any(isinstance(v, Exception) for v in checked.values()):
            result.errors = {u: str(v) for u, v in checked.items() if isinstance(v, Exception)}
            return result  # nothing touched
        if update.kind == "full" and update.manifest:
            fits = _parallel(lambda s: check_manifest(s.url, update.manifest, s.weight_manifest()), servers)
            if any(isinstance(v, Exception) for v in fits.values()):
                result.errors = {u: str(v) for u, v in fits.items() if isinstance(v, Exception)}
                return result  # nothing touched
        prev = {s.url: previous(s) if callable(previous) else previous for s in servers}
        paused = _parallel(lambda s: s.pause(pause_mode), servers)
        failed = {u: str(v) for u, v in paused.items() if isinstance(v, Exception)}
        touched: list[ServerClient] = []
        if not failed:
            def apply(s):
                if before_apply is not None:
                    before_apply(s)
                return strat.apply(s, update)

            touched = servers
            applied = _parallel(apply, servers)
            failed = {u: str(v) for u, v in applied.items() if isinstance(v, Exception)}
            result.reports = [v for v in applied.values() if isinstance(v, ServerReport)]
        if not failed:
            resumed = _parallel(lambda s: s.resume(), servers)
            result.errors = {u: str(v) for u, v in resumed.items() if isinstance(v, Exception)}
            result.ok = not result.errors  # all carry the new weights; a failed resume is reported
            return result
        result.errors = failed
        # Every touched server's state, asked anew; roll back the reachable ones, then resume those
        # verified on the old weights. Servers the pause never reached are resumed as they are.
        states = _parallel(lambda s: s.state(), servers)
        live = [s for s in servers if states[s.url] in ("serving", "paused")]
        to_roll = [s for s in live if s in touched]
        rolled = _parallel(lambda s: strat.rollback(s, prev[s.url]), to_roll)
        for url, v in rolled.items():
            if isinstance(v, Exception):
                result.left_paused[url] = str(v)
            else:
                result.rolled_back.append(url)
        resumable = [s for s in live if s.url not in result.left_paused]
        for url, v in _parallel(lambda s: s.resume(), resumable).items():
            if isinstance(v, Exception):
                result.left_paused[url] = f"resume failed: {v}"
        for s in servers:
            if s not in live:
                result.unreachable.append(s.url)
                result.errors.setdefault(s.url, "server stopped responding during the sync")
        return result
    finally:
        for s in servers:
            s.close()


def cmd_sync(args) -> int:
    from beam_rl.sync.lora import LoraHotLoadStrategy
    from beam_rl.sync.sources import full_update, lora_update, megatron_update, served_update

    sources = [x for x in (args.hf, args.megatron, args.lora) if x]
    if len(sources) != 1:
        raise InputError("give exactly one of --hf DIR, --megatron DIR, --lora DIR")
    t0 = time.perf_counter()
    if args.serve != "weights" and args.lora:
        raise InputError(f"--serve {args.serve} applies to full updates (--hf, --megatron), not to --lora adapters")
    if args.lora:
        update = lora_update(args.lora, args.lora_name)
        strategy = "lora"
        previous = lambda s: LoraHotLoadStrategy.previous(s, args.lora_name)  # noqa: E731  (queried per server)
    else:
        if not args.previous:
            raise InputError("--previous DIR is required: the checkpoint directory the servers serve now (the rollback target)")
        if args.megatron:
            if not args.staging:
                raise InputError("--megatron needs --staging DIR (where the converted HF checkpoint is written; the "
                                 "servers must be able to read it)")
            update = megatron_update(args.megatron, args.staging, config=args.config, serve=args.serve)
            print(f"converted {args.megatron} -> {update.path} ({update.nbytes / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
        elif args.serve != "weights":
            if not args.staging:
                raise InputError(f"--serve {args.serve} with --hf needs --staging DIR (where the served copy is written; the "
                                 "servers must be able to read it)")
            update = served_update(args.hf, args.staging, serve=args.serve)
            print(f"wrote {args.hf} as --serve {args.serve} -> {update.path} ({update.nbytes / 1e6:.1f} MB) in "
                  f"{time.perf_counter() - t0:.1f} s")
        else:
            update = full_update(args.hf)
        previous = full_update(args.previous)
        strategy = args.strategy
    options = {"master_address": args.master_address} if strategy in ("nccl", "gloo") else {}
    result = sync_servers(args.server, update, previous, strategy=strategy, strategy_options=options,
                          pause_mode=args.pause_mode, timeout_s=args.timeout)
    print(result.describe(), file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


def add_sync_parser(sub) -> None:
    p = sub.add_parser("sync", help="push new weights into running vLLM servers (all or nothing, verified)")
    p.add_argument("--server", action="append", required=True, help="server URL (repeat for several)")
    p.add_argument("--hf", help="Beam HF checkpoint directory to load")
    p.add_argument("--megatron", help="Megatron checkpoint (torch format, TP1) to convert and load")
    p.add_argument("--config", help="Beam config.json for --megatron (default: found beside the checkpoint)")
    p.add_argument("--staging", help="output directory of the --megatron conversion or of the --serve copy (readable by the servers)")
    p.add_argument("--serve", default="weights", choices=["weights", "mxfp8"],
                   help="weights: the checkpoint's weights; mxfp8: as an MXFP8 run's trainer computes with them (its "
                        "quantised linears' weights quantised and dequantised; the servers of an MXFP8 run need these "
                        "for its R3 gap; --previous is then the served copy the servers hold now)")
    p.add_argument("--lora", help="PEFT LoRA adapter directory to hot-load")
    p.add_argument("--lora-name", help="name to serve the adapter under (requests use it as `model`)")
    p.add_argument("--previous", help="checkpoint directory the servers serve now: the rollback target (full updates)")
    p.add_argument("--strategy", default="disk", choices=["disk", "nccl", "gloo"],
                   help="how full weights travel: disk (servers reload a directory they can read; default), nccl (broadcast "
                        "from this process's GPU through vLLM's weight-transfer API; servers run --weight-transfer-config "
                        "'{\"backend\": \"nccl\"}'), gloo (the same protocol over gloo, CPU servers: '{\"backend\": \"beam_gloo\"}')")
    p.add_argument("--master-address", default="127.0.0.1",
                   help="nccl / gloo: this machine's address as the servers' workers reach it (default 127.0.0.1)")
    p.add_argument("--pause-mode", default="wait", choices=["wait", "abort"],
                   help="in-flight requests: finish them first (wait, default) or abort them")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per server request")
    p.set_defaults(func=cmd_sync)
