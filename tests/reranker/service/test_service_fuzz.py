"""Property test: malformed requests never break the server.

A real server process (tiny converted model, both decoders) gets random and malformed requests:
random strings, huge lists, duplicate ids, NaN/inf scores, out-of-range options, unknown items,
empty candidates. Every reply must be OK (with a valid ranking) or INVALID_ARGUMENT naming a field;
the server must stay SERVING; and its resident memory must stay flat across the run.
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.diffusion_gr2.v1 import reranker_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny-model builder lives in test_service
from test_service import ITEMS, launch_server, make_service_dirs  # noqa: E402

from reranker.service.client import RerankerClient  # noqa: E402

N_EXAMPLES = 150
# Growth allowed between the end of the warm-up and the end of the run. A leak of even a few
# hundred bytes per request (payloads, futures, responses) would not show at this scale, but a
# leaked decode (KV cache, token tensors: ~MBs each) or growing per-request state would.
RSS_TOLERANCE_MB = 30
FIELD = re.compile(r"^(request|user_id|candidates|candidates\[\d+\]\.(item_id|score)|history\[\d+\]|"
                   r"options\.(decoder|tau|block_size|max_new_tokens)): ")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = make_service_dirs(tmp_path_factory.mktemp("fuzz"))
    proc, target, lines, _ = launch_server(d["diffusion"], d["data"], "--max-new-tokens", "24", "--max-batch", "4")
    try:
        with RerankerClient(target, timeout=60) as c:
            yield proc, c, target, lines
    finally:
        proc.kill()
        proc.wait()


def rss_mb(proc) -> float:
    return psutil.Process(proc.pid).memory_info().rss / 2**20


item_id = st.one_of(st.sampled_from(ITEMS), st.sampled_from(ITEMS), st.just(""),
                    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30), st.just("x" * 400))
score = st.floats(width=32, allow_nan=True, allow_infinity=True)
valid_candidates = st.lists(st.sampled_from(ITEMS), min_size=1, max_size=12, unique=True)
candidates = st.one_of(
    valid_candidates, valid_candidates,  # about half the requests reach the decoder
    st.lists(item_id, max_size=15),  # duplicates, unknown, empty, random strings
    st.integers(101, 2000).map(lambda n: [ITEMS[k % 30] + ("" if k < 30 else f"-{k}") for k in range(n)]),  # huge
)
options = st.builds(
    dict,
    decoder=st.sampled_from([0, 1, 2, 0, 1, 2, 3, 99]),
    tau=st.none() | st.sampled_from([0.5, 0.9, 1.0, 0.0, -1.0, 1.0001, 2.0, float("nan"), float("inf")]),
    block_size=st.none() | st.integers(0, 300),
    max_new_tokens=st.none() | st.integers(0, 30),
    top_k=st.integers(0, 200),
    return_reasoning=st.booleans(),
)


@st.composite
def requests(draw):
    cands = draw(candidates)
    scores = draw(st.one_of(st.lists(st.floats(-10, 10, width=32), min_size=len(cands), max_size=len(cands)),
                            st.lists(score, min_size=len(cands), max_size=len(cands))))
    history = draw(st.one_of(st.lists(st.sampled_from(ITEMS), max_size=80), st.lists(item_id, max_size=10)))
    opts = {k: v for k, v in draw(options).items() if v is not None}
    return pb.RerankRequest(user_id=draw(st.one_of(st.just("u1"), st.text(max_size=300))), history=history,
                            candidates=[pb.Candidate(item_id=c, score=s) for c, s in zip(cands, scores)],
                            options=pb.DecodeOptions(**opts))


def check_reply(c, req):
    try:
        resp = c.send(req, timeout=60)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert FIELD.match(e.details()), e.details()
        return
    n = len(req.candidates)
    prev = [it.previous_rank for it in resp.items]
    assert len(set(prev)) == len(prev) and all(1 <= p <= n for p in prev)
    assert [it.new_rank for it in resp.items] == list(range(1, len(prev) + 1))
    assert len(prev) == (min(req.options.top_k, n) or n)
    assert resp.fallback == (not resp.valid)
    assert [it.item_id for it in resp.items] == [req.candidates[p - 1].item_id for p in prev]


def test_undecodable_bytes_get_invalid_argument_and_no_traceback(live):
    proc, c, target, lines = live
    while not lines.empty():  # what the server logged so far is not this test's
        lines.get_nowait()
    with grpc.insecure_channel(target) as ch:
        for method, message in (("Rerank", "RerankRequest"), ("Recommend", "RecommendRequest")):
            call = ch.unary_unary(f"/diffusion_gr2.v1.Reranker/{method}")  # raw bytes in, raw bytes out
            for raw in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\x80" * 12):
                with pytest.raises(grpc.RpcError) as e:
                    call(raw, timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, e.value.details())
                assert e.value.details().startswith(f"request: the bytes are not a valid diffusion_gr2.v1.{message}")
    assert c.health() == "SERVING"
    time.sleep(0.5)
    logged = []
    while not lines.empty():
        logged.append(lines.get_nowait())
    assert not [x for x in logged if "Traceback" in x or "deserializ" in x], "".join(logged)


def test_malformed_requests_get_ok_or_invalid_argument(live):
    proc, c, _, _ = live
    # warm-up at the largest valid shapes, so the allocator has reached its working size
    for decoder in (pb.DECODER_AR, pb.DECODER_DIFFUSION):
        for k in range(3):
            check_reply(c, pb.RerankRequest(history=ITEMS * 2, candidates=[pb.Candidate(item_id=i) for i in ITEMS],
                                            options=pb.DecodeOptions(decoder=decoder, max_new_tokens=24 - k)))
    before = rss_mb(proc)
    seen = {"n": 0}

    @settings(max_examples=N_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(req=requests())
    def prop(req):
        seen["n"] += 1
        check_reply(c, req)
        assert c.health() == "SERVING"

    prop()
    after = rss_mb(proc)
    print(f"\nserver RSS {before:.1f} MB -> {after:.1f} MB over {seen['n']} requests")
    assert seen["n"] >= N_EXAMPLES
    assert after - before < RSS_TOLERANCE_MB, f"server RSS grew {after - before:.1f} MB over {seen['n']} requests"
    assert proc.poll() is None
