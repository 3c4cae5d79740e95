"""`dgr2 loadtest`: an asyncio gRPC load generator for a running re-ranking server.

`concurrency` workers share one channel and send Rerank calls until `n_requests` were sent or
`duration_limit_s` passed, whichever comes first (no call starts after the limit; one already sent
may take up to `timeout_s` more). The report has QPS, p50/p95/p99 latency of the successful calls,
error counts by status code, and the server's own stats (batch size, queue and decode
milliseconds, fallback rate).

Requests come from a JSONL file with `history`, `candidates`, `scores`, `user` per line (a
release bundle's test.jsonl and the retrieval artifacts' candidates/test.jsonl work as they are),
or are generated from a list of item ids.

The benchmark in the issue (Beauty, 5,000 requests per configuration, AR and diffusion at
concurrency 1, 8, 32), against one server per model, each started with `dgr2 serve --model ...`
(the AR teacher on one port, the block-diffusion student on another: the AR rows must time the
teacher, not the student decoded one token at a time):

    dgr2 loadtest --target ar=127.0.0.1:50061,diffusion=127.0.0.1:50062 \
        --requests models/amazon-beauty/test.jsonl --n 5000 \
        --decoders ar,diffusion --concurrency 1,8,32 --out docs/results/service-load.json

With `--resume-file F`, each finished configuration is appended to F and a later call with the
same settings reuses it: a call stopped after two hours resumes at the configuration it was in.

A bare `--target HOST:PORT` sends every decoder's requests to that one server. The overload
(`--n 0 --overload 400 --overload-rate 200`: 400 calls a method, 200 a second) goes against a
server started with a small `--max-queue` and `--retrieval`, so that Recommend is refused too.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from proto.diffusion_gr2.v1 import reranker_pb2 as pb
from proto.diffusion_gr2.v1 import reranker_pb2_grpc as pb_grpc

from candidate_gen.files import atomic_write_text, current_commit, file_sha256, read_jsonl

from ..decoding import add_decode_flags, explicit_from_args
from .client import channel, decode_options, rerank_request


def load_requests(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {history, candidates, scores?, user?} from a JSONL file (at most `limit`)."""
    rows = read_jsonl(path, {"candidates": list}, limit,
                      check=lambda row: None if row["candidates"] else "field 'candidates' is empty")
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def generate_requests(item_ids: Sequence[str], n: int, n_candidates: int = 10, history_len: int = 8,
                      seed: int = 0) -> list[dict]:
    """Random requests over a catalog: distinct candidates with decreasing scores, a random history."""
    if len(item_ids) < n_candidates + 1:
        raise ValueError(f"need more than {n_candidates} item ids to generate requests, got {len(item_ids)}")
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        picked = rng.sample(list(item_ids), n_candidates + history_len)
        rows.append({"user": f"load{k}", "history": picked[n_candidates:], "candidates": picked[:n_candidates],
                     "scores": [round(1.0 - j / n_candidates, 4) for j in range(n_candidates)]})
    return rows


def _percentiles(ms: list[float]) -> dict:
    if not ms:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "max": None}
    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def parse_targets(spec: str, decoders: Sequence[str]) -> dict[str, str]:
    """`--target`: "HOST:PORT" (every decoder's calls go there) or "DECODER=HOST:PORT,..." (one
    server per decoder, e.g. the AR teacher and the diffusion student). Every decoder needs one."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1 and "=" not in parts[0]:
        return {d: parts[0] for d in decoders}
    targets = {}
    for part in parts:
        name, sep, addr = part.partition("=")
        if not sep or not name or not addr:
            raise ValueError(f"--target: expected DECODER=HOST:PORT, got {part!r}")
        if name in targets:
            raise ValueError(f"--target: decoder {name!r} given twice")
        targets[name] = addr
    missing, unused = [d for d in decoders if d not in targets], sorted(set(targets) - set(decoders))
    if missing or unused:
        raise ValueError(f"--target: no server for decoders {missing}" if missing else
                         f"--target: servers for decoders not in --decoders: {unused}")
    return targets


def _rerank_requests(rows, opts) -> list:
    return [rerank_request(r["candidates"], r.get("history", []), r.get("scores"), str(r.get("user", "")), opts)
            for r in rows]


async def _run(target, rows, n_requests, concurrency, duration_limit_s, options, tls_ca, timeout_s):
    requests = _rerank_requests(rows, decode_options(**options))
    latencies, codes, stats = [], Counter(), []
    sent = 0
    async with channel(target, tls_ca, aio=True) as ch:
        stub = pb_grpc.RerankerStub(ch)
        t0 = time.perf_counter()
        end = t0 + duration_limit_s

        async def worker():
            nonlocal sent
            while sent < n_requests and time.perf_counter() < end:
                req = requests[sent % len(requests)]
                sent += 1
                start = time.perf_counter()
                try:
                    resp = await stub.Rerank(req, timeout=timeout_s)
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1
                    continue
                latencies.append((time.perf_counter() - start) * 1000.0)
                codes["OK"] += 1
                stats.append((resp.stats.batch_size, resp.stats.queue_ms, resp.stats.decode_ms, resp.fallback))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = codes.pop("OK", 0)
    s = np.asarray(stats, dtype=float) if stats else np.zeros((0, 4))
    return {
        "target": target, "concurrency": concurrency, "options": options, "requests_sent": sent, "ok": ok,
        "errors": dict(codes), "stopped_by": "count" if sent >= n_requests else "duration",
        "duration_s": wall, "qps": ok / wall if wall > 0 else 0.0, "latency_ms": _percentiles(latencies),
        "mean_batch_size": float(s[:, 0].mean()) if len(s) else None,
        "mean_queue_ms": float(s[:, 1].mean()) if len(s) else None,
        "mean_decode_ms": float(s[:, 2].mean()) if len(s) else None,
        "fallback_rate": float(s[:, 3].mean()) if len(s) else None,
    }


async def _send_overload(target, rows, method, n, options, tls_ca, timeout_s, rate=None):
    """`n` calls of `method`: all at once (`rate` None), or open loop at `rate` calls a second, call i
    sent at i / rate seconds whatever the earlier ones are waiting for. (status code name, ms from
    the call's send, ms it was sent after its due time) of each."""
    opts = decode_options(**options)
    if method == "Rerank":
        reqs = _rerank_requests(rows, opts)
    else:
        reqs = [pb.RecommendRequest(user_id=str(r.get("user", "")), history=list(r.get("history", [])), options=opts)
                for r in rows]
    async with channel(target, tls_ca, aio=True) as ch:
        call = getattr(pb_grpc.RerankerStub(ch), method)
        t0 = time.perf_counter()

        async def one(i):
            due = t0 + (i / rate if rate else 0.0)
            if rate:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            start = time.perf_counter()
            try:
                await call(reqs[i % len(reqs)], timeout=timeout_s)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            return code, (time.perf_counter() - start) * 1000.0, (start - due) * 1000.0

        return await asyncio.gather(*(one(i) for i in range(n)))


OVERLOAD_METHODS = ("Rerank", "Recommend")


def overload(target: str, requests, n_calls: int = 200, methods: Sequence[str] = OVERLOAD_METHODS,
             options: dict | None = None, tls_ca=None, timeout_s: float = 60.0, item_ids=None, seed: int = 0,
             rate: float | None = None) -> dict:
    """A deliberate overload: `n_calls` calls of each method against a server whose queue is far
    smaller (`dgr2 serve --max-queue`), sent open loop at `rate` calls a second (None: all at once).
    What a refused caller waits for its RESOURCE_EXHAUSTED is the figure (`refusal_p99_ms` per
    method); Recommend needs a server started with --retrieval.

    All at once measures the client more than the server: from one Python process, 400 calls at
    once against a server that refuses every call without any work took p99 55-90 ms on this CPU,
    while the same calls sent at 200-1000 a second took p99 1-6 ms (docs/EXPERIMENTS.md). The
    report keeps how late the client sent its calls (`send_lag_ms`), so a rate the client could not
    hold is seen."""
    bad = [m for m in methods if m not in OVERLOAD_METHODS]
    if bad or n_calls < 1 or (rate is not None and not rate > 0):
        raise ValueError(f"overload: methods must be of {OVERLOAD_METHODS}, n_calls >= 1 and rate > 0, got "
                         f"{list(methods)}, {n_calls}, {rate}")
    rows = _rows(requests, n_calls, item_ids, seed)
    out = {"calls_per_method": n_calls, "rate_per_s": rate, "options": dict(options or {})}
    for m in methods:
        res = asyncio.run(_send_overload(target, rows, m, n_calls, dict(options or {}), tls_ca, timeout_s, rate))
        refused = [ms for code, ms, _ in res if code == "RESOURCE_EXHAUSTED"]
        out[m] = {"codes": dict(Counter(code for code, *_ in res)), "refused": len(refused),
                  "refusal_ms": _percentiles(refused),
                  "ok_ms": _percentiles([ms for code, ms, _ in res if code == "OK"]),
                  "send_lag_ms": _percentiles([lag for *_, lag in res])}
    out["refusal_p99_ms"] = {m: out[m]["refusal_ms"]["p99"] for m in methods}
    return out


def _rows(requests, n_requests, item_ids, seed) -> list[dict]:
    if requests is None:
        if not item_ids:
            raise ValueError("give requests (a JSONL path or rows) or item_ids to generate them from")
        return generate_requests(item_ids, min(n_requests, 1000), seed=seed)
    if isinstance(requests, (str, Path)):
        return load_requests(requests, limit=n_requests)
    return list(requests)


def loadtest(target: str, requests: str | Path | list[dict] | None = None, n_requests: int = 1000,
             concurrency: int = 8, duration_limit_s: float = 300.0, options: dict | None = None,
             item_ids: Sequence[str] | None = None, tls_ca: str | Path | None = None,
             timeout_s: float = 30.0, seed: int = 0) -> dict:
    """Run one load configuration; returns the report dict (see the module docstring).

    `requests`: a JSONL path or a list of rows; None generates them from `item_ids`.
    `options`: decode_options() keywords (decoder, tau, block_size, max_new_tokens, top_k, ...).
    """
    if n_requests < 1 or concurrency < 1 or duration_limit_s <= 0:
        raise ValueError(f"need n_requests >= 1, concurrency >= 1, duration_limit_s > 0; got "
                         f"{n_requests}, {concurrency}, {duration_limit_s}")
    rows = _rows(requests, n_requests, item_ids, seed)
    return asyncio.run(_run(target, rows, n_requests, concurrency, duration_limit_s, dict(options or {}), tls_ca,
                            timeout_s))


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _matrix_key(requests, n_requests, duration_limit_s, kw) -> dict:
    """What every configuration of one matrix call shares, for its resume key (read once a call):
    the requests (a file by its bytes), their number, the duration limit, the other keywords."""
    if isinstance(requests, (str, Path)):
        src = f"file sha256 {file_sha256(requests)}" if Path(requests).is_file() else f"missing file {requests}"
    else:
        src = "generated" if requests is None else f"rows {_digest(requests)}"
    return {"requests": src, "n_requests": n_requests, "duration_limit_s": duration_limit_s,
            **{k: _digest(v) for k, v in sorted(kw.items())}}


def _run_key(shared: dict, target, concurrency, options) -> dict:
    """What makes two configurations the same run: a resumed matrix reuses a finished one only if
    every setting and the requests file's bytes are the same (JSON round trip: compared with keys read
    back from the file)."""
    return json.loads(json.dumps({"target": target, **shared, "concurrency": concurrency, "options": options}))


def cpu_model() -> str:
    """The processor's model name (Linux's cpuinfo), else platform.processor(): a resumed matrix may
    hold runs of several machines, and a ratio means something only if its two runs share one."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def read_finished_runs(path: Path) -> list[dict]:
    """The {key, run} lines of a resume file; a last line cut short by a kill is dropped."""
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            if not (isinstance(entry, dict) and isinstance(entry.get("key"), dict)
                    and isinstance(entry.get("run"), dict)):
                raise ValueError("not a {key, run} object")
        except ValueError as e:
            if i == len(lines):  # cut off, so that the next run's line starts on a line of its own
                print(f"{path}:{i}: an unfinished last line, dropped ({e})", file=sys.stderr)
                atomic_write_text(path, "".join(kept + "\n" for kept in lines[:-1]))
                continue
            raise ValueError(f"{path}:{i}: not a loadtest resume line ({e}); delete the file to start over") from None
        out.append(entry)
    return out


def loadtest_matrix(target: str | dict, requests=None, n_requests: int = 5000, decoders=("ar", "diffusion"),
                    concurrencies=(1, 8, 32), duration_limit_s: float = 600.0, options: dict | None = None,
                    resume_file: str | Path | None = None, **kw) -> dict:
    """loadtest for every decoder x concurrency; adds diffusion/AR QPS ratios per concurrency.
    target: one server for every decoder, or {decoder: server} (parse_targets).
    resume_file: each finished configuration is appended there, and a later call with the same
    settings reuses it instead of sending its requests again (a matrix of 5,000 requests per
    configuration runs for hours on a CPU; a killed call resumes at the configuration it was in).
    Each run records when it finished (`finished_utc`), the commit and the CPU it was measured on,
    so a resumed report shows its spread. The decoders of one concurrency run back to back, so the
    two runs of a ratio are measured together, and a matrix stopped part way holds whole pairs."""
    targets = target if isinstance(target, dict) else {d: target for d in decoders}
    resume = Path(resume_file) if resume_file else None
    finished = read_finished_runs(resume) if resume else []
    shared = _matrix_key(requests, n_requests, duration_limit_s, kw) if resume else {}
    measured_on = {"commit": current_commit(), "cpu": cpu_model()}  # what this call's runs were measured with
    runs = []
    for c in concurrencies:
        for d in decoders:
            opts = {**(options or {}), "decoder": d}
            key = _run_key(shared, targets[d], c, opts)
            done = next((e["run"] for e in finished if e["key"] == key), None)
            if done is not None:
                print(f"{d} c={c}: finished at {done.get('finished_utc')}, reused from {resume}", flush=True)
                runs.append(done)
                continue
            print(f"{d} c={c}: {n_requests} requests to {targets[d]}", flush=True)
            run = loadtest(targets[d], requests, n_requests, c, duration_limit_s, opts, **kw)
            run.update(finished_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **measured_on)
            runs.append(run)
            if resume:
                resume.parent.mkdir(parents=True, exist_ok=True)
                with resume.open("a", encoding="utf-8") as f:  # one line per run: a kill loses at most the last
                    f.write(json.dumps({"key": key, "run": run}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
    qps = {(r["options"]["decoder"], r["concurrency"]): r["qps"] for r in runs}
    ratios = {str(c): qps[("diffusion", c)] / qps[("ar", c)] for c in concurrencies
              if qps.get(("ar", c)) and ("diffusion", c) in qps}
    return {"runs": runs, "diffusion_over_ar_qps": ratios}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dgr2 loadtest", description="Load-test a running re-ranking server.")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="HOST:PORT for every decoder, or DECODER=HOST:PORT,... (one server per model)")
    p.add_argument("--requests", help="JSONL with history/candidates/scores/user per line")
    p.add_argument("--items", help="JSON list of item ids to generate requests from (instead of --requests)")
    p.add_argument("--n", type=int, default=1000, help="requests per configuration")
    p.add_argument("--concurrency", default="8", help="comma-separated, e.g. 1,8,32")
    p.add_argument("--decoders", default="ar", help="comma-separated: ar,diffusion")
    p.add_argument("--duration-limit-s", type=float, default=600.0, help="per configuration")
    names = ("tau", "block_size", "commit_rule", "hold_eos", "max_new_tokens", "window", "reuse_settled",
             "lookup_drafts", "compute_dtype")
    add_decode_flags(p, names, {n: "unset: the server's default" for n in names})
    p.add_argument("--tls-ca")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--overload", type=int, default=0, metavar="N",
                   help="after the runs, send N calls of each of --overload-methods (a deliberate overload of a "
                        "server started with a small --max-queue) and report the refusals")
    p.add_argument("--overload-rate", type=float, default=None, metavar="PER_S",
                   help="send the overload's calls open loop at this many a second (unset: all at once, which "
                        "from one client measures the client's own sending more than the server)")
    p.add_argument("--overload-methods", default="Rerank,Recommend", help="Recommend needs `serve --retrieval`")
    p.add_argument("--out", help="write the report as a docs/results JSON file")
    p.add_argument("--resume-file", help="JSONL of finished configurations: appended as each finishes, and a "
                                         "later call with the same settings reuses them (resume after a kill)")
    args = p.parse_args(argv)
    decoders = args.decoders.split(",")
    try:
        targets = parse_targets(args.target, decoders)
    except ValueError as e:
        p.error(str(e))
    options = explicit_from_args(args)
    item_ids = json.loads(Path(args.items).read_text()) if args.items else None
    report = {"runs": []}
    if args.n > 0:  # --n 0: the overload alone
        report = loadtest_matrix(targets, args.requests, args.n, decoders,
                                 [int(c) for c in args.concurrency.split(",")], args.duration_limit_s, options,
                                 resume_file=args.resume_file, item_ids=item_ids, tls_ca=args.tls_ca,
                                 timeout_s=args.timeout_s)
    if args.overload:
        report["overload"] = overload(targets[decoders[0]], args.requests, args.overload,
                                      args.overload_methods.split(","), {**options, "decoder": decoders[0]},
                                      args.tls_ca, args.timeout_s, item_ids, rate=args.overload_rate)
        for m, ms in report["overload"]["refusal_p99_ms"].items():
            print(f"overload {m}: {report['overload'][m]['codes']}, refusal p99 "
                  + (f"{ms:.1f} ms" if ms is not None else "- (nothing refused)"))
    for r in report["runs"]:
        lat = r["latency_ms"]
        print(f"{r['options']['decoder']:>9} c={r['concurrency']:<3} qps={r['qps']:8.2f} "
              f"p50={lat['p50'] or 0:8.1f} p95={lat['p95'] or 0:8.1f} p99={lat['p99'] or 0:8.1f} ms "
              f"ok={r['ok']} errors={r['errors']}")
    if args.out:
        from candidate_gen.files import write_result

        write_result(args.out, report, "dgr2 loadtest " + " ".join(argv if argv is not None else sys.argv[1:]))
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
