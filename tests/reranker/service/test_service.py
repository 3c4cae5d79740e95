"""The gRPC service: real tiny engine for the decode path, a slow fake only for queue/deadline/drain timing."""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from proto.diffusion_gr2.v1 import reranker_pb2 as pb
from reranker.engine import DecodeOptions, RerankEngine, RerankRequest, RerankResult
from reranker.service.client import RerankerClient, client_main, rerank_request
from reranker.service.server import BackgroundServer, ServerConfig, serve
from reranker.service.validation import ServiceLimits

torch.set_num_threads(1)
ITEMS = [f"i{k:02d}" for k in range(30)]
REPO = Path(__file__).resolve().parents[3]


# ---- a real tiny model + re-ranking data directory on disk ------------------------------------
def make_service_dirs(root: Path) -> dict:
    """model/ (tiny random Qwen3 + tokenizer), diffusion/ (converted), data/ (sids, build_info),
    retrieval/ (sequences.json) and items.item: everything RerankEngine.load reads."""
    from reranker.diffusion.convert import convert_to_diffusion
    from reranker.model import SIZES, build_model, save_model
    from reranker.text.prompt import render_assistant
    from reranker.text.sid import build_semantic_ids
    from reranker.text.tokenizer import build_tokenizer

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    rows = ["item_id:token\ttitle:token_seq\tbrand:token\tcategories:token_seq"]
    rows += [f"{it}\tThing {k}\tBrand{k % 4}\tBeauty Leaf{k % 5}" for k, it in enumerate(ITEMS)]
    (root / "items.item").write_text("\n".join(rows) + "\n")
    seqs = {f"u{u}": [ITEMS[(u * 7 + 3 * k) % 30] for k in range(8)] for u in range(40)}
    (root / "retrieval").mkdir(exist_ok=True)
    (root / "retrieval" / "sequences.json").write_text(json.dumps(seqs))
    sids = build_semantic_ids(rng.normal(size=(30, 8)).astype(np.float32), ITEMS, codebook_size=4)
    (root / "data").mkdir(exist_ok=True)
    sids.save(root / "data" / "sids.json")
    (root / "data" / "build_info.json").write_text(json.dumps({
        "retrieval_dir": "../retrieval", "items_path": "../items.item", "copurchase_window": 1,
        "profile": "cpu", "max_prompt_tokens": 4096}))
    corpus = [render_assistant("brand match and cobought evidence", [sids.sid_string(i) for i in ITEMS[:10]])] * 5
    tok = build_tokenizer(corpus + [f"History Candidates retriever order cobought brand category {t}" for t in ITEMS],
                          vocab_size=400)
    # tiny, with a context that holds 100 candidates' prompt (the service checks prompts against it)
    model = build_model(len(tok), size={**SIZES["tiny"], "max_position_embeddings": 4096},
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0)
    save_model(model, tok, root / "model")
    convert_to_diffusion(root / "model", root / "diffusion", block_size=4)
    return {"root": root, "model": root / "model", "diffusion": root / "diffusion", "data": root / "data",
            "seqs": seqs}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_service_dirs(tmp_path_factory.mktemp("service"))


@pytest.fixture(scope="module")
def engine(dirs):
    return RerankEngine.load(dirs["diffusion"], dirs["data"])  # converted: serves both decoders


def limits(**kw):
    return ServiceLimits(**{"max_new_tokens": 24, **kw})


def config(**kw):
    lim = kw.pop("limits", None) or limits()
    return ServerConfig(port=0, limits=lim, **kw)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, config(max_batch=4, max_wait_ms=100, limits=limits(max_history=6))) as srv:
        srv.warmed.result(120)
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with RerankerClient(server.target, timeout=60) as c:
        yield c


def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


# ---- a slow fake engine: only for queue / deadline / drain timing -----------------------------
class SlowEngine:
    """Sleeps `max_new_tokens` x step_s in steps, calling a real nn.Module each step so the server's
    abandon hook can stop it between "forward passes" as it does on the real model."""

    def __init__(self, step_s: float = 0.01):
        self.model = torch.nn.Identity()
        self.sids = SimpleNamespace(item_ids=ITEMS)
        self.diffusion = None
        self.step_s = step_s
        self.gate = threading.Event()
        self.gate.set()
        self.started, self.finished = [], []
        self.forwards = 0

    def known(self, item):
        return item in ITEMS

    def rerank(self, requests, options, prompts=None):
        self.gate.wait(30)
        self.started.append([r.user for r in requests])
        for _ in range(options.max_new_tokens):
            self.model(torch.zeros(1))
            self.forwards += 1
            time.sleep(self.step_s)
        self.finished.append([r.user for r in requests])
        return [RerankResult(list(range(len(r.candidates)))[::-1], True, False, None, "slow", "", 1, 1, 0.0)
                for r in requests]


def slow_config(**kw):
    return config(limits=limits(max_new_tokens=1000), **kw)  # max_new_tokens = the fake's sleep steps


def slow_request(user, steps, **kw):
    return rerank_request(ITEMS[:3], ["i10"], user_id=user,
                          options=pb.DecodeOptions(max_new_tokens=steps, **kw))


# ---- tests ------------------------------------------------------------------------------------
def test_rerank_real_engine_ar_and_diffusion(client):
    for decoder in ("ar", "ar_lookup", "diffusion"):
        resp = client.rerank(ITEMS[:10], history=ITEMS[20:23], scores=[1.0 - k / 10 for k in range(10)],
                             user_id="u1", decoder=decoder, tau=0.8, block_size=4)
        assert sorted(it.previous_rank for it in resp.items) == list(range(1, 11))
        assert [it.new_rank for it in resp.items] == list(range(1, 11))
        assert resp.fallback == (not resp.valid)
        if resp.fallback:  # a random model: the retriever order comes back
            assert [it.item_id for it in resp.items] == ITEMS[:10] and resp.failure
        assert resp.items[0].score == pytest.approx(1.0) and resp.reasoning == ""
        st = resp.stats
        assert st.decoder == decoder and 0 < st.generated_tokens <= 24 and st.forward_passes >= 1
        assert st.decode_ms > 0 and st.queue_ms >= 0 and st.batch_size == 1
        assert resp.history_used == 3 and not resp.history_truncated


def test_history_truncation_and_top_k(client):
    resp = client.rerank(ITEMS[:5], history=ITEMS[10:20] + ["new-item"], top_k=2, max_new_tokens=4)
    assert resp.history_truncated and resp.history_used == 6 and resp.history_unknown == 1
    assert len(resp.items) == 2


def test_valid_answer_is_reranked_with_reasoning(dirs):
    from reranker.text.prompt import render_assistant

    eng = RerankEngine.load(dirs["model"], dirs["data"])
    order = [2, 0, 1]
    text = render_assistant("brand match", [eng.sids.sid_string(ITEMS[i]) for i in order]) + "<|im_end|>"
    ids = eng.tokenizer(text, add_special_tokens=False)["input_ids"]
    eng.decode = lambda prompts, options: ([ids for _ in prompts], 1, None)  # this instance only
    with BackgroundServer(eng, config()) as srv, RerankerClient(srv.target) as c:
        srv.warmed.result(60)
        resp = c.rerank(ITEMS[:3], return_reasoning=True)
        assert resp.valid and not resp.fallback and resp.reasoning == "brand match"
        assert [(it.item_id, it.previous_rank, it.new_rank) for it in resp.items] == [
            ("i02", 3, 1), ("i00", 1, 2), ("i01", 2, 3)]
        code, msg = code_of(lambda: c.rerank(ITEMS[:3], decoder="diffusion"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("options.decoder: diffusion needs")


def test_micro_batching_groups_same_options(server):
    with RerankerClient(server.target) as c, ThreadPoolExecutor(6) as pool:
        same = [pool.submit(c.rerank, ITEMS[k:k + 5], max_new_tokens=8, decoder="ar") for k in range(4)]
        other = [pool.submit(c.rerank, ITEMS[k:k + 5], max_new_tokens=8, decoder="diffusion") for k in range(2)]
        same, other = [f.result(60) for f in same], [f.result(60) for f in other]
    assert max(r.stats.batch_size for r in same) >= 2  # 100 ms wait: concurrent calls share a decode
    assert all(r.stats.decoder == "diffusion" and r.stats.batch_size <= 2 for r in other)
    for r in same + other:
        assert sorted(it.previous_rank for it in r.items) == [1, 2, 3, 4, 5]


def test_a_decoder_can_have_its_own_batch_cap(engine):
    """`--decoder-max-batch diffusion=1`: diffusion requests decode one at a time while AR ones
    still share a decode (max_batch 4); a bad cap is refused at configuration."""
    from reranker.service.options import parse_decoder_max_batch

    assert parse_decoder_max_batch("diffusion=1, ar=8") == {"diffusion": 1, "ar": 8}
    for bad, msg in [("beam=2", "unknown decoder 'beam'"), ("diffusion=0", ">= 1"), ("diffusion", "DECODER=N")]:
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            parse_decoder_max_batch(bad)
    cfg = config(max_batch=4, max_wait_ms=300, decoder_max_batch={"diffusion": 1})
    with BackgroundServer(engine, cfg) as srv, RerankerClient(srv.target) as c, ThreadPoolExecutor(8) as pool:
        srv.warmed.result(120)
        ar = [pool.submit(c.rerank, ITEMS[k:k + 5], max_new_tokens=8, decoder="ar") for k in range(4)]
        diff = [pool.submit(c.rerank, ITEMS[k:k + 5], max_new_tokens=8, decoder="diffusion") for k in range(4)]
        ar, diff = [f.result(60) for f in ar], [f.result(60) for f in diff]
    assert max(r.stats.batch_size for r in ar) >= 2
    assert [r.stats.batch_size for r in diff] == [1, 1, 1, 1]


def test_one_unrenderable_request_does_not_fail_its_batch(dirs):
    eng = RerankEngine.load(dirs["model"], dirs["data"])
    short = len(eng.prompt_ids(RerankRequest(history=[], candidates=ITEMS[:3])))
    eng.max_prompt_tokens = short + 40  # 3 candidates fit, 25 do not
    # max_candidates above what fits: the prompt check itself must refuse the long one
    with BackgroundServer(eng, config(max_batch=4, max_wait_ms=300, limits=limits(max_candidates=100))) as srv, \
            RerankerClient(srv.target) as c, ThreadPoolExecutor(2) as pool:
        srv.warmed.result(60)
        ok = pool.submit(c.rerank, ITEMS[:3], max_new_tokens=4)
        long = pool.submit(code_of, lambda: c.rerank(ITEMS[:25], max_new_tokens=4))
        code, msg = long.result(60)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("candidates: the model cannot take"), msg
        assert len(ok.result(60).items) == 3

        def broken(prompts, options):
            raise RuntimeError("decoder exploded")

        eng.decode = broken  # a crashing decode still answers, in retriever order
        resp = c.rerank(ITEMS[:3], max_new_tokens=4)
        assert resp.fallback and not resp.valid and resp.failure == "decode_error"
        assert [it.item_id for it in resp.items] == ITEMS[:3]


BAD = [  # (request fields, field named in the message)
    (dict(candidates=[]), "candidates"),
    (dict(candidates=[f"x{k}" for k in range(101)]), "candidates"),
    (dict(candidates=["i01", "i02", "i01"]), "candidates[2].item_id"),
    (dict(candidates=["i01", "nope"]), "candidates[1].item_id"),
    (dict(candidates=["i01", ""]), "candidates[1].item_id"),
    (dict(candidates=["i01", "i02"], scores=[0.5, float("nan")]), "candidates[1].score"),
    (dict(candidates=["i01"], scores=[float("inf")]), "candidates[0].score"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(tau=0.0)), "options.tau"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(tau=1.5)), "options.tau"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(tau=float("nan"))), "options.tau"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(block_size=0)), "options.block_size"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(block_size=257)), "options.block_size"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(max_new_tokens=10_000)), "options.max_new_tokens"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(decoder=7)), "options.decoder"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(commit_rule=9)), "options.commit_rule"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(compute_dtype=9)), "options.compute_dtype"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(window=0)), "options.window"),
    (dict(candidates=["i01"], options=pb.DecodeOptions(window=300)), "options.window"),
    (dict(candidates=["i01"], history=["i02", ""]), "history[1]"),
    (dict(candidates=["i01"], user_id="u" * 300), "user_id"),
]


@pytest.mark.parametrize("fields,field", BAD, ids=[b[1] + str(k) for k, b in enumerate(BAD)])
def test_invalid_argument_names_the_field(client, fields, field):
    fields = dict(fields)
    req = rerank_request(fields.pop("candidates"), fields.pop("history", []), fields.pop("scores", None),
                         fields.pop("user_id", ""), fields.pop("options", None))
    code, msg = code_of(lambda: client.send(req))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    assert msg.startswith(field + ":"), msg


def test_compute_dtype_reaches_the_engine_as_its_name(tmp_path, capsys):
    """options.compute_dtype (an enum) reaches the engine's DecodeOptions as "float32"/"bfloat16";
    unset: the server's --compute-dtype, else float32. The client, its CLI and the load test send it."""
    from reranker.decoding import explicit_from_args
    from reranker.service.client import decode_options
    from reranker.service.loadtest import main as loadtest_main
    from reranker.service.options import SERVER_DECODE_FLAGS, add_serve_arguments

    assert decode_options().compute_dtype == pb.COMPUTE_DTYPE_UNSPECIFIED
    assert decode_options(compute_dtype="bfloat16").compute_dtype == pb.COMPUTE_DTYPE_BFLOAT16
    assert decode_options(compute_dtype="float32").compute_dtype == pb.COMPUTE_DTYPE_FLOAT32
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        decode_options(compute_dtype="float16")
    p = argparse.ArgumentParser()
    add_serve_arguments(p)  # `dgr2 serve --compute-dtype`: the default of requests that send none
    assert explicit_from_args(p.parse_args(["--model", "m", "--compute-dtype", "bfloat16"]),
                              SERVER_DECODE_FLAGS) == {"compute_dtype": "bfloat16"}
    items = tmp_path / "items.json"
    items.write_text(json.dumps(ITEMS))
    for server_default, unset in ((None, "float32"), ("bfloat16", "bfloat16")):
        eng = SlowEngine(step_s=0.0)
        seen = recording(eng)
        lim = limits(max_new_tokens=1000, decode={"compute_dtype": server_default})
        with BackgroundServer(eng, config(limits=lim, max_batch=1, max_wait_ms=0)) as srv, \
                RerankerClient(srv.target) as c:
            srv.warmed.result(30)
            del seen[:]  # the warm-up's decodes
            for sent, want in ((None, unset), ("bfloat16", "bfloat16"), ("float32", "float32")):
                c.rerank(ITEMS[:3], max_new_tokens=1, compute_dtype=sent)
                assert seen.pop()[0].compute_dtype == want, (server_default, sent)
            assert client_main(["rerank", "--target", srv.target, "--candidates", "i01,i02", "--max-new-tokens", "1",
                                "--compute-dtype", "float32"]) == 0
            assert seen.pop()[0].compute_dtype == "float32"
            assert loadtest_main(["--target", srv.target, "--items", str(items), "--n", "2", "--concurrency", "1",
                                  "--max-new-tokens", "1", "--compute-dtype", "bfloat16"]) == 0
            assert [o.compute_dtype for o, _ in seen] == ["bfloat16", "bfloat16"]
    capsys.readouterr()


def test_bfloat16_decodes_under_autocast_on_the_decode_thread(engine, client):
    """The real engine: a bfloat16 request's forwards run under autocast, a float32 one's do not."""
    autocast = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args: autocast.append(torch.is_autocast_enabled(engine.model.device.type)))
    try:
        for dtype in ("bfloat16", "float32"):
            del autocast[:]
            resp = client.rerank(ITEMS[:5], history=ITEMS[20:22], decoder="diffusion", max_new_tokens=8,
                                 compute_dtype=dtype)
            assert sorted(it.previous_rank for it in resp.items) == [1, 2, 3, 4, 5]
            assert autocast and set(autocast) == {dtype == "bfloat16"}, (dtype, autocast)
    finally:
        hook.remove()


def test_message_size_limits(engine):
    with BackgroundServer(engine, config(limits=limits(max_message_bytes=2000, max_history=10_000))) as srv, \
            RerankerClient(srv.target) as c:
        srv.warmed.result(60)
        big = rerank_request(["i01"], ["i02"] * 400)  # ~2.4 kB: over the limit, under gRPC's 4x cap
        code, msg = code_of(lambda: c.send(big))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("request:"), msg
        huge = rerank_request(["i01"], ["i02"] * 4000)  # ~24 kB: refused by gRPC before the handler
        assert code_of(lambda: c.send(huge))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.health() == "SERVING"


def test_overload_is_rejected_fast_and_accepted_complete():
    step_s, tokens = 0.02, 30  # one accepted decode takes >= 0.6 s (sleeps, not CPU)
    eng = SlowEngine(step_s=step_s)
    with BackgroundServer(eng, slow_config(max_batch=1, max_queue=2, max_wait_ms=0)) as srv, \
            RerankerClient(srv.target) as c:
        srv.warmed.result(30)
        c.rerank(ITEMS[:3], max_new_tokens=1)  # connect before timing anything

        def timed(k):
            t = time.perf_counter()
            code, _ = code_of(lambda: c.send(slow_request(f"r{k}", tokens)))
            return code, time.perf_counter() - t

        with ThreadPoolExecutor(10) as pool:
            out = list(pool.map(timed, range(10)))
    ok = [t for code, t in out if code == grpc.StatusCode.OK]
    rejected = [t for code, t in out if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    # exactly --max-queue admitted, the decoding request included (the old queue took 2 more beside it)
    assert len(ok) + len(rejected) == 10 and len(ok) == 2, out
    # Rejected without waiting for a decode slot: every refusal is back before one decode could
    # have finished. (Not a wall-clock bar: on a quiet machine they take a few ms, on a loaded one
    # the same code path took ~0.24 s; a timed assertion would fail by load, not by a bug.)
    assert max(rejected) < step_s * tokens <= min(ok), (rejected, ok)
    assert sum(len(b) for b in eng.finished) == len(ok) + 2  # +2: warm-up and the connect call


@pytest.mark.parametrize("workers", [1, 2])
def test_decode_workers_decode_that_many_batches_at_once(workers):
    """`--decode-workers N`: N batches decode at once (each on its own thread); with one, the
    second request waits for the first."""
    eng = SlowEngine(step_s=0.0)
    with BackgroundServer(eng, slow_config(max_batch=1, max_wait_ms=0, decode_workers=workers)) as srv, \
            RerankerClient(srv.target) as c, ThreadPoolExecutor(2) as pool:
        srv.warmed.result(30)
        eng.gate.clear()  # decodes block until the gate opens

        async def counts():
            return srv.service.batcher.running, srv.service.batcher.queued

        calls = [pool.submit(c.rerank, ITEMS[:3], max_new_tokens=2, user_id=f"u{k}") for k in range(2)]
        deadline = time.monotonic() + 30
        while srv.call(counts()) != (workers, 2 - workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen = srv.call(counts())
        eng.gate.set()
        assert [len(f.result(30).items) for f in calls] == [3, 3]
    assert seen == (workers, 2 - workers)
    with pytest.raises(ValueError, match="decode_workers"):
        slow_config(decode_workers=0)


def test_a_batch_decoding_alone_gets_every_thread_and_concurrent_ones_share_them(monkeypatch):
    """Two workers sharing 4 torch threads: warm-up and a lone request decode on worker 0 with all
    4; two batches decoding at once run worker 0 on 2 and the other on 1; worker 0 takes all 4 back
    before its next forward once it decodes alone again."""
    shares = []  # (decode thread, threads asked for), in order
    monkeypatch.setattr(torch, "set_num_threads", lambda n: shares.append((threading.current_thread().name, n)))
    eng = SlowEngine(step_s=0.002)
    w0, w1 = "rerank-decode-0_0", "rerank-decode-1_0"
    with BackgroundServer(eng, slow_config(max_batch=1, max_wait_ms=0, decode_workers=2, decode_threads=4)) as srv, \
            RerankerClient(srv.target) as c, ThreadPoolExecutor(2) as pool:
        srv.warmed.result(30)
        for k in range(3):  # one at a time: always worker 0, always every thread
            assert c.rerank(ITEMS[:3], max_new_tokens=3, user_id=f"alone{k}").items
        assert [x for x in shares if x[0].startswith("rerank-decode")] == [(w0, 4)], shares
        eng.gate.clear()  # both decodes wait at the gate until both are running
        # (decoding_batches is one len(); the decode threads read it off the event loop too)
        long_one = pool.submit(c.rerank, ITEMS[:3], max_new_tokens=400, user_id="long")  # 0.8 s of steps
        deadline = time.monotonic() + 30
        while srv.service.batcher.decoding_batches < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        short_one = pool.submit(c.rerank, ITEMS[:3], max_new_tokens=3, user_id="short")
        while srv.service.batcher.decoding_batches < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        eng.gate.set()
        assert long_one.result(30).items and short_one.result(30).items
    decode = [x for x in shares if x[0].startswith("rerank-decode")]
    assert decode[0] == (w0, 4) and sorted(decode[1:3]) == [(w0, 2), (w1, 1)], shares  # beside each other
    assert decode[3:] == [(w0, 4)], shares  # the long one, alone again
    with pytest.raises(ValueError, match="decode_threads"):
        slow_config(decode_threads=-1)


def test_deadline_while_decoding_abandons_the_work():
    eng = SlowEngine(step_s=0.01)
    with BackgroundServer(eng, slow_config(max_batch=1)) as srv, RerankerClient(srv.target) as c:
        srv.warmed.result(30)
        before = eng.forwards
        code, msg = code_of(lambda: c.send(slow_request("late", 300), timeout=0.3))  # needs ~3 s
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.2)
        assert ["late"] in eng.started and ["late"] not in eng.finished
        assert eng.forwards - before < 100  # stopped between forward passes, long before 300
        assert c.send(slow_request("next", 2)).items  # the worker is free again


def test_deadline_while_queued_skips_the_work():
    eng = SlowEngine(step_s=0.01)
    with BackgroundServer(eng, slow_config(max_batch=1)) as srv, RerankerClient(srv.target) as c:
        srv.warmed.result(30)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(c.send, slow_request("first", 60))  # ~0.6 s of decoding
            while ["first"] not in eng.started:
                time.sleep(0.005)
            code, _ = code_of(lambda: c.send(slow_request("queued", 5), timeout=0.2))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert first.result(10).items
        time.sleep(0.1)
        assert ["queued"] not in eng.started  # never decoded


def test_health_reflection_warmup_and_drain():
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from google.protobuf.descriptor_pool import DescriptorPool

    eng = SlowEngine(step_s=0.01)
    eng.gate.clear()  # hold the warm-up
    srv = BackgroundServer(eng, slow_config(max_batch=1))
    try:
        with RerankerClient(srv.target) as c:
            # reflection, grpcurl-style: list services, then describe the service from the server alone
            db = ProtoReflectionDescriptorDatabase(c.channel)
            assert {"diffusion_gr2.v1.Reranker", "grpc.health.v1.Health"} <= set(db.get_services())
            methods = DescriptorPool(db).FindServiceByName("diffusion_gr2.v1.Reranker").methods_by_name
            assert {"Rerank", "Recommend"} <= set(methods)

            assert c.health() == "NOT_SERVING" and c.health("diffusion_gr2.v1.Reranker") == "NOT_SERVING"
            eng.gate.set()
            srv.warmed.result(30)
            assert c.health() == "SERVING" and c.health("diffusion_gr2.v1.Reranker") == "SERVING"

            with ThreadPoolExecutor(1) as pool:
                inflight = pool.submit(c.send, slow_request("inflight", 80))  # ~0.8 s
                while ["inflight"] not in eng.started:
                    time.sleep(0.005)
                drained = srv.submit(srv.running.drain(grace_s=10))
                time.sleep(0.1)
                assert c.health() == "NOT_SERVING"
                code, msg = code_of(lambda: c.send(slow_request("late", 1)))
                assert code == grpc.StatusCode.UNAVAILABLE and "draining" in msg
                assert not drained.done()
                resp = inflight.result(10)  # the in-flight request finishes
                assert [it.item_id for it in resp.items] == ITEMS[:3][::-1]
                drained.result(20)
            assert ["late"] not in eng.started
    finally:
        srv.stop()


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A throwaway certificate for localhost / 127.0.0.1 (openssl CLI; `cryptography` is not installed)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_tls_by_option_and_loopback_default(tmp_path):
    assert ServerConfig().host == "127.0.0.1"
    import inspect
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    cert, key = self_signed(tmp_path)
    eng = SlowEngine()
    with BackgroundServer(eng, slow_config(tls_cert=str(cert), tls_key=str(key))) as srv:
        srv.warmed.result(30)
        assert srv.target.startswith("127.0.0.1:")
        with RerankerClient(srv.target, tls_ca=cert, timeout=10) as c:
            assert c.health() == "SERVING"
            assert [it.item_id for it in c.send(slow_request("tls", 1)).items] == ["i02", "i01", "i00"]
        with RerankerClient(srv.target, timeout=2) as plain:  # plaintext to a TLS port fails
            assert code_of(lambda: plain.health(timeout=2))[0] == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="both tls_cert and tls_key"):
        BackgroundServer(eng, slow_config(tls_cert=str(cert)))


def test_client_main_prints_json(server, capsys):
    target = server.target
    assert client_main(["health", "--target", target]) == 0
    assert json.loads(capsys.readouterr().out) == {"status": "SERVING"}
    assert client_main(["rerank", "--target", target, "--candidates", "i01,i02,i03", "--scores", "3,2,1",
                        "--history", "i05", "--max-new-tokens", "4", "--top-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["items"]) == 2 and out["stats"]["decoder"] == "diffusion"  # what the converted model records
    assert client_main(["rerank", "--target", target, "--candidates", "i01,i02,i03", "--max-new-tokens", "4",
                        "--commit-rule", "prefix", "--hold-eos", "--tau", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["decoder"] == "diffusion"
    assert client_main(["rerank", "--target", target, "--candidates", "i01,nope"]) == 1
    assert "INVALID_ARGUMENT: candidates[1].item_id" in capsys.readouterr().err
    assert client_main(["recommend", "--target", target, "--history", "i01"]) == 1
    assert "FAILED_PRECONDITION" in capsys.readouterr().err


def test_loadtest_small(server):
    from reranker.service.loadtest import loadtest

    rep = loadtest(server.target, None, n_requests=12, concurrency=4, duration_limit_s=60,
                   options={"max_new_tokens": 6}, item_ids=ITEMS)
    assert rep["ok"] == 12 and rep["errors"] == {} and rep["requests_sent"] == 12 and rep["qps"] > 0
    lat = rep["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert rep["mean_batch_size"] >= 1 and rep["stopped_by"] == "count"
    short = loadtest(server.target, [{"candidates": ITEMS[:4]}], n_requests=10_000, concurrency=2,
                     duration_limit_s=0.5, options={"max_new_tokens": 4})
    assert short["stopped_by"] == "duration" and short["requests_sent"] < 10_000


def test_loadtest_matrix_sends_each_decoder_to_its_own_server(dirs, server):
    """The AR rows time the AR model's server, the diffusion rows the student's (one server per
    model), and `--target` says which is which."""
    from reranker.service.loadtest import loadtest_matrix, parse_targets

    assert parse_targets("h:1", ["ar", "diffusion"]) == {"ar": "h:1", "diffusion": "h:1"}
    assert parse_targets("ar=h:1, diffusion=h:2", ["ar", "diffusion"]) == {"ar": "h:1", "diffusion": "h:2"}
    for spec, msg in [("ar=h:1", r"no server for decoders \['diffusion'\]"), ("ar=h:1,ar=h:2", "given twice"),
                      ("ar=h:1,diffusion=h:2,ar_lookup=h:3", "not in --decoders"), ("ar=,diffusion=h:2", "DECODER=")]:
        with pytest.raises(ValueError, match=msg):
            parse_targets(spec, ["ar", "diffusion"])
    with BackgroundServer(RerankEngine.load(dirs["model"], dirs["data"]), config(max_batch=2)) as ar_server:
        ar_server.warmed.result(120)
        rep = loadtest_matrix({"ar": ar_server.target, "diffusion": server.target}, None, n_requests=4,
                              decoders=("ar", "diffusion"), concurrencies=(2,), duration_limit_s=60,
                              options={"max_new_tokens": 4}, item_ids=ITEMS)
    assert [(r["options"]["decoder"], r["target"], r["ok"]) for r in rep["runs"]] == [
        ("ar", ar_server.target, 4), ("diffusion", server.target, 4)]
    assert set(rep["diffusion_over_ar_qps"]) == {"2"}



def test_a_resumed_loadtest_matrix_reuses_finished_configurations_only(server, tmp_path, monkeypatch, capsys):
    """A killed matrix resumes at the configuration it was in: finished ones are read back from the
    resume file (not sent again), a changed setting runs anew, a line cut short by the kill is
    dropped, and a corrupt line elsewhere names the file and line."""
    from reranker.service import loadtest as lt

    resume = tmp_path / "runs.jsonl"
    kw = dict(decoders=("diffusion",), concurrencies=(1, 2), duration_limit_s=60, options={"max_new_tokens": 4},
              item_ids=ITEMS, resume_file=resume)
    first = lt.loadtest_matrix(server.target, None, n_requests=3, **kw)
    assert [r["ok"] for r in first["runs"]] == [3, 3] and all(r["finished_utc"] for r in first["runs"])
    assert all(r["commit"] and r["cpu"] for r in first["runs"])  # a resumed matrix may span machines: each run says
    assert len(resume.read_text().splitlines()) == 2
    with resume.open("a") as f:
        f.write('{"key": {"target"')  # a kill mid-line

    def no_requests(*a, **k):
        raise AssertionError("a finished configuration was sent again")

    with monkeypatch.context() as m:
        m.setattr(lt, "loadtest", no_requests)
        again = lt.loadtest_matrix(server.target, None, n_requests=3, **kw)
    assert again["runs"] == first["runs"]
    assert "unfinished last line, dropped" in capsys.readouterr().err
    more = lt.loadtest_matrix(server.target, None, n_requests=4, **kw)  # another setting: sent
    assert [r["requests_sent"] for r in more["runs"]] == [4, 4]
    lines = resume.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["run"] for line in lines)
    resume.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"runs.jsonl:2: not a loadtest resume line"):
        lt.loadtest_matrix(server.target, None, n_requests=3, **kw)


def test_a_matrix_runs_each_concurrencys_decoders_back_to_back(monkeypatch, tmp_path):
    """The two runs of a ratio are measured one after the other, so a matrix stopped part way (and
    resumed later, perhaps elsewhere) holds whole pairs."""
    from reranker.service import loadtest as lt

    sent = []

    def fake(target, requests, n, c, limit, opts, **kw):
        sent.append((opts["decoder"], c))
        return {"options": opts, "concurrency": c, "qps": 1.0 + (opts["decoder"] == "diffusion")}

    monkeypatch.setattr(lt, "loadtest", fake)
    rep = lt.loadtest_matrix("h:1", None, 2, ("ar", "diffusion"), (1, 8), item_ids=ITEMS,
                             resume_file=tmp_path / "runs.jsonl")
    assert sent == [("ar", 1), ("diffusion", 1), ("ar", 8), ("diffusion", 8)]
    assert rep["diffusion_over_ar_qps"] == {"1": 2.0, "8": 2.0}


# ---- Recommend: a real RecBole SASRec + FAISS index over the same 30 items ---------------------
TINY_SASREC = {"epochs": 1, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
               "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 10, "show_progress": False}


@pytest.fixture(scope="module")
def retrieval_dir(dirs):
    from candidate_gen.index import ItemIndex
    from candidate_gen.sasrec import SasrecEncoder, train_sasrec, write_recbole_dataset

    d = dirs["root"] / "retrieval"
    write_recbole_dataset(d / "data", "toy", dirs["seqs"])
    run = train_sasrec(d / "data", "toy", d / "sasrec", TINY_SASREC, seed=0, evaluate=False)
    emb, _ = SasrecEncoder(run.model, run.dataset).item_embeddings(ITEMS)
    ItemIndex.build(emb, ITEMS, "flat").save(d / "index")
    return d


def test_recommend_retrieves_then_reranks(engine, retrieval_dir):
    from reranker.service.retrieval import Retriever

    retriever = Retriever.load(retrieval_dir)
    history = ["i03", "i10", "i17"]
    expected, scores = retriever.retrieve(history, 5)
    with BackgroundServer(engine, config(), retriever=retriever) as srv, RerankerClient(srv.target) as c:
        srv.warmed.result(60)
        resp = c.recommend(history, num_candidates=5, max_new_tokens=8)
        res = resp.result
        assert sorted(it.item_id for it in res.items) == sorted(expected)
        assert not set(expected) & set(history) and resp.retrieval_ms > 0
        by_prev = {it.previous_rank: it for it in res.items}
        assert [by_prev[k + 1].item_id for k in range(5)] == expected
        assert by_prev[1].score == pytest.approx(scores[0], rel=1e-5)
        for req, field in ((dict(history=[]), "history"), (dict(history=["zz"]), "history"),
                           (dict(history=history, num_candidates=500), "num_candidates"),
                           (dict(history=history, tau=2.0), "options.tau")):
            code, msg = code_of(lambda: c.recommend(**req))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith(field + ":"), msg


# ---- the real entry point under SIGTERM ---------------------------------------------------------
def _lines(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)


def launch_server(model_dir, data_dir, *extra, timeout: float = 90.0):
    """`python -m reranker.service.server` on a free port; returns (process, target, log lines, reader)
    once it logs SERVING (the lines up to then: `process.startup_log`). The caller kills the process."""
    cmd = [sys.executable, "-m", "reranker.service.server", "--model", str(model_dir), "--data", str(data_dir),
           "--port", "0", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    log, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            log.append(lines.get(timeout=1))
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if "SERVING on " in log[-1]:
            proc.startup_log = "".join(log)
            return proc, log[-1].rsplit("SERVING on ", 1)[1].strip(), lines, reader
    proc.kill()
    proc.wait()
    raise AssertionError("server did not become SERVING:\n" + "".join(log))


def test_sigterm_drains_the_real_server(dirs):
    proc, target, lines, reader = launch_server(dirs["model"], dirs["data"], "--max-batch", "1",
                                                "--max-new-tokens", "400", "--drain-grace-s", "20")
    log = []
    try:
        # the loaded heap is out of the collector's full collections before the server says SERVING
        froze = re.search(r"froze (\d+) loaded objects", proc.startup_log)
        assert froze and int(froze.group(1)) > 1000, proc.startup_log
        with RerankerClient(target, timeout=60) as c:
            assert c.health() == "SERVING"
            done = []
            # six calls started from this thread (gRPC's own threads put them on the wire), decoded one at
            # a time, ~0.3 s each; SIGTERM once the first is answered, when the other five were surely
            # admitted: a loaded machine may delay a worker thread's send, not these
            futures = [c.stub.Rerank.future(rerank_request(ITEMS[k:k + 10], ["i20"],
                                                           options=pb.DecodeOptions(max_new_tokens=400)), timeout=60)
                       for k in range(6)]
            for f in futures:
                f.add_done_callback(lambda _: done.append(time.monotonic()))
            while not done:
                time.sleep(0.01)
            sent_term = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            in_flight = len(done) < len(futures)
            try:
                status = c.health(timeout=5)
            except grpc.RpcError as e:  # stopped already: only possible when nothing was left in flight
                status = e.code().name
            results = [f.result(60) for f in futures]
        assert all(len(r.items) == 10 for r in results)
        assert max(done) > sent_term, "every request finished before SIGTERM: nothing was in flight"
        if in_flight:
            assert status == "NOT_SERVING"
        assert proc.wait(30) == 0
        reader.join(10)
        while not lines.empty():
            log.append(lines.get())
        text = "".join(log)
        assert "SIGTERM: draining" in text and "stopped" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the service decodes as `dgr2 eval` does -----------------------------------------------------
EXAMPLES = [{"user": f"u{k}", "history": ITEMS[20 + k:23 + k], "candidates": ITEMS[k:k + 5],
             "scores": [1.0 - j / 10 for j in range(5)], "target_index": k % 5} for k in range(3)]


def recording(engine) -> list:
    """Make this engine instance record each batch's decode options and generated texts."""
    seen, real = [], engine.rerank

    def rerank(requests, options=None, prompts=None):
        out = real(requests, options, prompts=prompts)
        seen.append((options, [r.text for r in out]))
        return out

    engine.rerank = rerank
    return seen


def test_grpc_rankings_equal_eval_outputs(dirs, tmp_path):
    from integration.cli import main

    with open(dirs["data"] / "test.jsonl", "w") as f:
        f.writelines(json.dumps(ex) + "\n" for ex in EXAMPLES)
    # a copy of the student that records the prefix rule: callers that send no settings get it
    recorded = tmp_path / "student"
    recorded.mkdir()
    for p in dirs["diffusion"].iterdir():
        (recorded / p.name).write_bytes(p.read_bytes())
    assert main(["model", "decode-settings", str(recorded), "--commit-rule", "prefix", "--tau", "0.3",
                 "--hold-eos"]) == 0
    prefix = dict(decoder="diffusion", tau=0.3, commit_rule="prefix", hold_eos=True)
    cases = [  # (model, settings sent by both eval and the request)
        (dirs["diffusion"], dict(decoder="ar")),
        (dirs["diffusion"], dict(decoder="diffusion", tau=0.3, commit_rule="confidence")),
        (dirs["diffusion"], prefix),
        (recorded, {}),  # nothing sent: the model's recorded prefix settings
        (dirs["diffusion"], dict(prefix, window=2, reuse_settled=True)),  # the approximations reach the decoder
        (dirs["diffusion"], dict(prefix, lookup_drafts=True)),  # and the lookup drafts
    ]
    texts = []
    for model_dir, settings in cases:
        flags = [f for k, v in settings.items() for f in
                 ([f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)])]
        out = tmp_path / "outputs.jsonl"
        assert main(["eval", "--model", str(model_dir), "--data", str(dirs["data"]), "--max-new-tokens", "24",
                     "--batch-size", "1", "--outputs", str(out), *flags]) == 0
        expected = [json.loads(line) for line in out.read_text().splitlines()]

        eng = RerankEngine.load(model_dir, dirs["data"])
        seen = recording(eng)
        with BackgroundServer(eng, config(max_batch=1)) as srv, RerankerClient(srv.target, timeout=60) as c:
            srv.warmed.result(60)
            del seen[:]  # the warm-up's decodes
            for ex, want in zip(EXAMPLES, expected):
                resp = c.rerank(ex["candidates"], ex["history"], ex["scores"], ex["user"], **settings)
                got = [it.previous_rank - 1 for it in resp.items]
                assert got == want["permutation"], (settings, got, want)
                assert (resp.valid, resp.failure or None) == (want["valid"], want["failure"])
                assert resp.stats.generated_tokens == want["generated_tokens"]
                assert resp.stats.forward_passes == want["forward_passes"]
        # the same settings reached the decoder, and it wrote the same text eval did
        used = {o.key for o, _ in seen}
        assert len(used) == 1, used
        options = seen[0][0]
        assert (options.decoder, options.tau if options.decoder == "diffusion" else None) == (
            settings.get("decoder", "diffusion"), settings.get("tau", 0.3) if options.decoder == "diffusion" else None)
        if model_dir == recorded or settings.get("commit_rule") == "prefix":
            assert (options.commit_rule, options.hold_eos) == ("prefix", True)
        assert (options.window, options.reuse_settled) == (settings.get("window"), settings.get("reuse_settled", False))
        assert options.lookup_drafts == settings.get("lookup_drafts", False)
        assert [t for _, ts in seen for t in ts] == [w["text"] for w in expected]
        texts.append([w["text"] for w in expected])
    assert texts[1] != texts[2] and texts[2] == texts[3]  # the rule changes the decode; the record is used


def test_convert_records_the_decode_settings(dirs, tmp_path):
    from integration.cli import main
    from reranker.decoding import recorded_in

    assert recorded_in(dirs["model"]) == {} and recorded_in(dirs["diffusion"]) == {"decoder": "diffusion"}
    out = tmp_path / "converted"
    assert main(["convert", "--from", str(dirs["model"]), "--to", str(out), "--block-size", "4",
                 "--commit-rule", "prefix", "--no-hold-eos"]) == 0  # --block-size is the conversion's own
    assert recorded_in(out) == {"decoder": "diffusion", "commit_rule": "prefix", "hold_eos": False}
    assert RerankEngine.load(out, dirs["data"]).decode_options({"tau": 0.5}) == DecodeOptions(
        decoder="diffusion", commit_rule="prefix", tau=0.5)


# ---- probes: refusals before work, the context limit, drain time, metrics ---------------------------
def test_prompt_over_the_context_is_refused_at_the_handler(dirs):
    eng = RerankEngine.load(dirs["model"], dirs["data"])
    ctx = eng.model.config.max_position_embeddings
    calls = []
    real = eng.rerank
    eng.rerank = lambda requests, options=None, prompts=None: calls.append(len(requests)) or real(
        requests, options, prompts=prompts)
    five = len(eng.prompt_ids(RerankRequest(history=[ITEMS[-1]], candidates=ITEMS[:5])))
    six = len(eng.prompt_ids(RerankRequest(history=[ITEMS[-1]], candidates=ITEMS[:6])))
    assert five < six
    budget = ctx - five  # exactly five candidates fit beside this many new tokens
    with BackgroundServer(eng, config(limits=limits(max_new_tokens=budget))) as srv, \
            RerankerClient(srv.target, timeout=20) as c:
        srv.warmed.result(60)
        # --max-candidates left unset: derived from what fits, not 100
        assert srv.service.limits.max_candidates == 5
        code, msg = code_of(lambda: c.rerank(ITEMS[:6], [ITEMS[-1]]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith("candidates: 6 candidates; at most 5")
    with BackgroundServer(eng, config(limits=limits(max_new_tokens=budget, max_candidates=100))) as srv, \
            RerankerClient(srv.target, timeout=20) as c:
        srv.warmed.result(60)
        del calls[:]
        code, msg = code_of(lambda: c.rerank(ITEMS[:6], [ITEMS[-1]], max_new_tokens=budget))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, msg)
        assert msg.startswith("candidates: the model cannot take this request") and \
            f"max_position_embeddings={ctx} - max_new_tokens={budget}" in msg, msg
        assert calls == []  # refused at the handler: the decode thread never saw it
        assert len(c.rerank(ITEMS[:6], [ITEMS[-1]], max_new_tokens=4).items) == 6  # a smaller budget fits


class CountingRetriever:
    """Recommend's retriever, counting the retrievals."""

    def __init__(self):
        self.calls = 0

    def known(self, item):
        return item in ITEMS

    def allowed_mask(self, known):
        return None

    def retrieve(self, history, n, allowed=None):
        self.calls += 1
        items = [i for i in ITEMS if i not in history][:n]
        return items, [1.0] * len(items)


def test_recommend_checks_admission_before_it_retrieves():
    eng, retriever = SlowEngine(step_s=0.01), CountingRetriever()
    with BackgroundServer(eng, slow_config(max_batch=1, max_queue=1, max_wait_ms=0), retriever=retriever) as srv, \
            RerankerClient(srv.target, timeout=30) as c, ThreadPoolExecutor(2) as pool:
        srv.warmed.result(30)
        busy = [pool.submit(code_of, lambda k=k: c.send(slow_request(f"busy{k}", 100))) for k in range(2)]
        while not eng.started[1:]:  # the warm-up, then the first busy request decoding
            time.sleep(0.005)
        time.sleep(0.05)
        code, msg = code_of(lambda: c.recommend(["i03"], num_candidates=3))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, msg)
        assert retriever.calls == 0  # refused before any retrieval
        assert sorted(f.result(30)[0].name for f in busy) == ["OK", "RESOURCE_EXHAUSTED"]
        assert c.recommend(["i03"], num_candidates=3).result.items and retriever.calls == 1


def test_loadtest_overload_reports_refusals_per_method():
    """`dgr2 loadtest --overload N`: N calls of Rerank and of Recommend at once against a queue of 2;
    the report counts what was refused and how long a refused caller waited."""
    from reranker.service.loadtest import overload

    eng, retriever = SlowEngine(step_s=0.01), CountingRetriever()
    with BackgroundServer(eng, slow_config(max_batch=1, max_queue=2, max_wait_ms=0), retriever=retriever) as srv:
        srv.warmed.result(30)
        rows = [{"candidates": ITEMS[:3], "history": ["i20"], "user": "u"}]
        rep = overload(srv.target, rows, n_calls=12, options={"max_new_tokens": 20})
    for m in ("Rerank", "Recommend"):
        codes = rep[m]["codes"]
        assert sum(codes.values()) == 12 and codes.get("RESOURCE_EXHAUSTED", 0) == rep[m]["refused"] >= 8, codes
        assert codes.get("OK", 0) >= 1 and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
        assert rep["refusal_p99_ms"][m] == rep[m]["refusal_ms"]["p99"] > 0
    with pytest.raises(ValueError, match="methods must be of"):
        overload("127.0.0.1:1", rows, methods=["Nope"])
    with pytest.raises(ValueError, match="rate > 0"):
        overload("127.0.0.1:1", rows, rate=0)


def test_loadtest_overload_open_loop_sends_on_schedule():
    """`--overload-rate R`: call i leaves at i / R seconds, not before, whatever the earlier calls
    wait for; each call's lateness is reported, and refusals are timed from the call's own send."""
    from reranker.service.loadtest import overload

    eng = SlowEngine(step_s=0.01)
    with BackgroundServer(eng, slow_config(max_batch=1, max_queue=2, max_wait_ms=0)) as srv:
        srv.warmed.result(30)
        rows = [{"candidates": ITEMS[:3], "history": ["i20"], "user": "u"}]
        t0 = time.perf_counter()
        rep = overload(srv.target, rows, n_calls=20, methods=["Rerank"], options={"max_new_tokens": 20}, rate=50.0)
        took = time.perf_counter() - t0
    assert took >= 19 / 50.0, took  # the last call was due at 0.38 s
    r = rep["Rerank"]
    assert rep["rate_per_s"] == 50.0 and sum(r["codes"].values()) == 20 and r["refused"] >= 1, r["codes"]
    assert r["send_lag_ms"]["p50"] > -1.0 and r["send_lag_ms"]["p99"] < 1000 * 19 / 50.0, r["send_lag_ms"]
    # a refusal is answered without decoding: far under the 20-step decode an admitted call waits for
    assert rep["refusal_p99_ms"]["Rerank"] < r["ok_ms"]["p50"], r


def test_sigterm_exits_within_grace_plus_one_second(dirs):
    grace = 1.0
    proc, target, lines, reader = launch_server(dirs["model"], dirs["data"], "--max-batch", "1",
                                                "--max-new-tokens", "1500", "--drain-grace-s", str(grace))
    try:
        # six decodes of 1,500 tokens, one at a time: several seconds of work in all, far more than the
        # grace, though one of them may finish inside it on a fast machine
        with RerankerClient(target, timeout=60) as c, ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(code_of, lambda k=k: c.rerank(ITEMS[k:k + 10], ["i20"], max_new_tokens=1500))
                       for k in range(6)]
            time.sleep(0.5)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(30)
            took = time.monotonic() - sent
            codes = [f.result(30)[0] for f in futures]
        assert rc == 0
        assert took <= grace + 1.0, f"exited {took:.2f} s after SIGTERM with a {grace} s grace"
        # the work outlasted the grace: what was left of it was cut, not waited for
        assert codes.count(grpc.StatusCode.OK) < len(codes) and set(codes) <= {grpc.StatusCode.OK,
                                                                              grpc.StatusCode.UNAVAILABLE}, codes
        reader.join(10)
        text = "".join(lines.get() for _ in range(lines.qsize()))
        assert "SIGTERM: draining" in text and "stopped" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{(name, labels as a sorted tuple): value} from /metrics over loopback."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_prometheus_metrics_over_loopback(engine, server):
    port = free_port()
    # a second server in the same process as the module's: each has its own registry
    with BackgroundServer(engine, config(metrics_port=port)) as srv, RerankerClient(srv.target, timeout=60) as c:
        srv.warmed.result(60)
        assert srv.running.metrics_port == port
        for decoder in ("ar", "diffusion"):
            c.rerank(ITEMS[:4], ["i20"], decoder=decoder, max_new_tokens=8)
        assert code_of(lambda: c.rerank(["nope"]))[0] == grpc.StatusCode.INVALID_ARGUMENT
        # an aborted call's status can reach the client before its handler has counted it: scrape
        # until all three calls are counted (a scraper sees the same, one scrape later)
        deadline = time.monotonic() + 10
        while True:
            m = scrape(port)
            counted = m.get(("dgr2_request_latency_seconds_count", (("method", "Rerank"),)))
            if counted == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert m[("dgr2_requests_total", (("code", "OK"), ("method", "Rerank")))] == 2
    assert m[("dgr2_requests_total", (("code", "INVALID_ARGUMENT"), ("method", "Rerank")))] == 1
    assert m[("dgr2_request_latency_seconds_count", (("method", "Rerank"),))] == 3
    assert m[("dgr2_queue_depth", ())] == 0
    for decoder in ("ar", "diffusion"):
        d = (("decoder", decoder),)
        assert m[("dgr2_batch_size_count", d)] >= 1  # the warm-up's decode and the request's
        results = m[("dgr2_rerank_results_total", d)]
        assert results >= 1 and 0 <= m[("dgr2_fallbacks_total", d)] <= results
        assert m[("dgr2_tokens_per_forward_count", d)] >= 1
    assert 0 < m[("dgr2_tokens_per_forward_sum", (("decoder", "ar"),))] / \
        m[("dgr2_tokens_per_forward_count", (("decoder", "ar"),))] <= 1.0  # AR: one token per forward
    with pytest.raises(OSError):  # stopped with its server
        scrape(port)


def test_a_data_dir_without_its_retrieval_run_names_what_is_missing(dirs, tmp_path):
    """Copied away from the retrieval run it reads its evidence from, a data directory is refused with
    the build_info.json field and the missing file, not a bare file-not-found from inside the loader."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(dirs["data"], data)
    with pytest.raises(FileNotFoundError, match=r"build_info\.json: retrieval_dir '\.\./retrieval' names .*"
                                                r"sequences\.json, which is missing"):
        RerankEngine.load(dirs["diffusion"], data)
    (tmp_path / "retrieval").mkdir()
    shutil.copy(dirs["root"] / "retrieval" / "sequences.json", tmp_path / "retrieval")
    with pytest.raises(FileNotFoundError, match=r"items_path '\.\./items\.item' names .*items\.item, which is missing"):
        RerankEngine.load(dirs["diffusion"], data)
    shutil.copy(dirs["root"] / "items.item", tmp_path / "items.item")
    assert RerankEngine.load(dirs["diffusion"], data).known(ITEMS[0])


def test_a_pre_ranked_model_needs_scores_and_gets_the_whole_history_length():
    """A model with a pre-ranker orders candidates by features of their scores and of the history's
    length: a request whose scores are all unset is refused naming the field, and Recommend's cut
    history still reports its whole length; a failed decode answers the listed order."""
    from reranker.service.server import _fallback
    from reranker.service.validation import ValidationError, validate_rerank

    req = pb.RerankRequest(user_id="u", history=[f"h{k}" for k in range(5)],
                           candidates=[pb.Candidate(item_id=f"c{k}") for k in range(3)])
    limits = ServiceLimits(max_new_tokens=24, max_history=2)
    with pytest.raises(ValidationError, match="candidates: every score is 0"):
        validate_rerank(req, lambda i: True, limits, False, needs_scores=True)
    prep = validate_rerank(req, lambda i: True, limits, False)  # a model without one: zeros are fine
    assert prep.request.history == ["h3", "h4"] and prep.request.history_len == 5
    prep = validate_rerank(req, lambda i: True, limits, False, history_len=40)
    assert prep.request.history_len == 40
    listed = SimpleNamespace(list_order=lambda r: [2, 0, 1])
    assert _fallback(listed, prep.request, "decode_error").permutation == [2, 0, 1]
    broken = SimpleNamespace(list_order=lambda r: 1 / 0)
    assert _fallback(broken, prep.request, "decode_error").permutation == [0, 1, 2]
