"""The gRPC re-ranking server (grpc.aio): Rerank, Recommend, health, reflection, micro-batching.

Lifecycle: bind (health NOT_SERVING) -> warm up the model (one small decode per decoder) -> SERVING
-> on SIGTERM/SIGINT `drain`: health NOT_SERVING, new Rerank/Recommend calls get UNAVAILABLE, the
queued and decoding requests finish (bounded by the grace period), then the server stops and
`serve` ends the process.

A handler refuses before it works: draining (UNAVAILABLE), then a place in the bounded queue
(RESOURCE_EXHAUSTED), then validation and, for Recommend, retrieval; then it renders the prompt and
checks it fits the model's context (INVALID_ARGUMENT naming the limit), so the decode thread only
gets requests it can decode. Decode settings a request leaves unset are the server's defaults: its
flags over the model's recorded settings (reranker.decoding).

    python -m reranker.service.server --model DIR --data DIR [--retrieval DIR] [--port 50051]

Loopback only by default; TLS with --tls-cert/--tls-key. Decoding runs on `--decode-workers` worker
threads (see batcher.py) that share torch's threads by how many batches decode at once; a batch
whose callers all left (deadline, cancellation) is abandoned between two forward passes by a
forward pre-hook on the model, the same hook that adjusts the batch's thread share.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.diffusion_gr2.v1 import reranker_pb2 as pb
from proto.diffusion_gr2.v1 import reranker_pb2_grpc as pb_grpc

from ..decoding import DecodeOptions, resolve
from ..engine import RerankRequest, RerankResult
from .batcher import Admission, BatcherClosed, MicroBatcher, QueueFull
from .metrics import ServiceMetrics
from .options import (CANDIDATES_CAP, SERVER_DECODE_FLAGS, ServerConfig, ServiceLimits, add_serve_arguments,
                      check_decoder_max_batch)
from .validation import (Prepared, ValidationError, build_response, truncate_history, validate_options,
                         validate_rerank)

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Reranker"].full_name  # "diffusion_gr2.v1.Reranker"
# gRPC itself refuses messages this many times larger than the handler's limit (RESOURCE_EXHAUSTED);
# between the two, the handler answers INVALID_ARGUMENT naming the field "request".
TRANSPORT_HEADROOM = 4
# How long gRPC's stop may take after the drain: to send the answers of calls that finished (at
# least), or to send CANCELLED to calls the grace cut. Both keep the exit within grace + 1 s.
SEND_GRACE_S = 0.5
CANCEL_GRACE_S = 0.1


class _Abandoned(Exception):
    """Raised inside the model's forward when every caller of the running batch has gone."""


def _fallback(engine, req: RerankRequest, failure: str) -> RerankResult:
    """The answer of a request whose decode failed: the order its prompt lists (the retriever's, or
    the model's pre-ranker's), as for an invalid answer; the retriever's if even that fails."""
    try:
        order = engine.list_order(req) if hasattr(engine, "list_order") else list(range(len(req.candidates)))
    except Exception:  # noqa: BLE001 -- the fallback of a failed decode must not fail too
        order = list(range(len(req.candidates)))
    return RerankResult(permutation=order, valid=False, fallback=True, failure=failure, reasoning="",
                        text="", generated_tokens=0, forward_passes=0, decode_seconds=0.0)


def default_options(engine, limits: ServiceLimits) -> DecodeOptions:
    """What a request that sets nothing decodes with: the server's decode flags over the model's
    recorded settings over the defaults; the budget capped by --max-new-tokens."""
    resolved = resolve(limits.decode, getattr(engine, "recorded", None))  # a stand-in engine records none
    return replace(resolved, max_new_tokens=min(resolved.max_new_tokens, limits.max_new_tokens))


def fitting_candidates(engine, max_new_tokens: int, cap: int = CANDIDATES_CAP) -> int:
    """The most candidates (at most `cap`) whose prompt, with one history item, fits the model's
    context beside `max_new_tokens`: the default of --max-candidates. Candidates' evidence differs
    in length, so the handler still checks each request's own prompt."""
    sids = getattr(engine, "sids", None)
    items = list(getattr(sids, "item_ids", ()))
    if not hasattr(engine, "prompt_ids") or len(items) < 2:
        return cap
    history, pool = items[-1:], items[:-1]

    def fits(n: int) -> bool:
        try:
            engine.prompt_ids(RerankRequest(history=history, candidates=pool[:n], scores=[0.0] * n), max_new_tokens)
            return True
        except ValueError:
            return False

    hi = min(cap, len(pool))
    if fits(hi):
        return cap  # a catalog smaller than cap: a request cannot name more items than it has
    if not fits(1):
        raise ValueError(f"no request fits the model's context: even one candidate's prompt does not fit beside "
                         f"max_new_tokens={max_new_tokens}; lower --max-new-tokens")
    lo = 1  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class RerankerService(pb_grpc.RerankerServicer):
    def __init__(self, engine, limits: ServiceLimits | None = None, retriever=None, max_batch: int = 8,
                 max_wait_ms: float = 5.0, max_queue: int = 64, decoder_max_batch: dict | None = None,
                 decode_workers: int = 1, decode_threads: int = 0):
        self.engine = engine
        # torch threads the decode workers share (see _share_threads)
        self.decode_threads = decode_threads or torch.get_num_threads()
        self._thread_share = threading.local()
        self.decoder_max_batch = check_decoder_max_batch(decoder_max_batch)
        limits = limits or ServiceLimits()
        self.diffusion_available = getattr(engine, "diffusion", None) is not None
        # a model with a pre-ranker orders the candidates by features of their retriever scores
        self._needs_scores = getattr(engine, "preranker", None) is not None
        self.defaults = default_options(engine, limits)
        if self.defaults.decoder == "diffusion" and not self.diffusion_available:
            raise ValueError("decoder 'diffusion' needs a converted model (dgr2 convert); this one is AR only")
        if limits.max_candidates is None:
            limits = replace(limits, max_candidates=fitting_candidates(engine, limits.max_new_tokens))
            log.info("max_candidates %d: what fits the model's context beside max_new_tokens %d",
                     limits.max_candidates, limits.max_new_tokens)
        self.limits = limits
        self.retriever = retriever
        self.health = health.aio.HealthServicer()
        self.batcher = MicroBatcher(self._decode_batch, max_batch, max_wait_ms, max_queue, decode_workers)
        self.metrics = ServiceMetrics(lambda: self.batcher.admitted)
        # Prompts render on their own thread: the event loop stays free to refuse and answer while a
        # long prompt tokenizes, and one thread keeps renders (the tokenizer) in arrival order.
        self._render_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rerank-render")
        # Recommend's retrieval (a SASRec forward) on one thread with one torch thread (_share_threads)
        self._retrieve_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="recommend-retrieve", initializer=pin_torch_threads, initargs=(1,))
        self.draining = False
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._allowed = None  # index rows the engine can rank (Recommend)

    # ---- decode thread ---------------------------------------------------------------------
    def _share_threads(self) -> None:
        """On a decode thread, before a forward: set how many torch threads this batch runs on.
        Worker 0, where a batch arriving alone always goes (batcher.py), takes every thread while it
        decodes alone and decode_threads // k while k batches decode at once; the other workers run
        on one. Only worker 0 ever runs a multi-threaded op: each thread that does owns an OpenMP
        team, and with more team threads in the process than cores libgomp stops spin-waiting, which
        made every multi-threaded decode about 1.7x slower here (docs/EXPERIMENTS.md). Per thread,
        so called only when the share changes."""
        if self.batcher.current_worker() == 0:
            share = max(1, self.decode_threads // max(1, self.batcher.decoding_batches))
        else:
            share = 1
        if getattr(self._thread_share, "n", None) != share:
            pin_torch_threads(share)
            self._thread_share.n = share

    def _decode_batch(self, preps: list[Prepared], key, should_stop) -> list:
        """Runs on the decode thread: one engine.rerank for the batch; never raises."""
        def before_forward(module, args):
            if should_stop():
                raise _Abandoned()
            self._share_threads()

        # checked before every forward pass, so a batch nobody waits for stops within one step and a
        # batch's thread share follows the others starting and ending
        model = getattr(self.engine, "model", None)
        hook = model.register_forward_pre_hook(before_forward) if isinstance(model, torch.nn.Module) else None
        try:
            results = self._rerank_isolating(preps)
            self.metrics.observe_batch(preps[0].options.decoder, results)
            return results
        except _Abandoned:
            log.info("abandoned a batch of %d: every caller left (deadline or cancellation)", len(preps))
            return [asyncio.CancelledError("abandoned")] * len(preps)
        finally:
            if hook is not None:
                hook.remove()

    def _rerank_isolating(self, preps: list[Prepared]) -> list:
        options = replace(preps[0].options)  # all share the batch key
        requests = [p.request for p in preps]
        prompts = [p.prompt_ids for p in preps]
        try:
            if any(p is None for p in prompts):  # an engine without prompt_ids (test fakes) renders its own
                return self.engine.rerank(requests, options)
            return self.engine.rerank(requests, options, prompts=prompts)
        except _Abandoned:
            raise
        except ValueError:
            # A request the engine cannot render (e.g. a prompt over the model's budget) fails the
            # whole batch: find it without decoding, answer it INVALID_ARGUMENT, decode the others.
            bad = {}
            for i, r in enumerate(requests):
                try:
                    self.engine.prompt_ids(r)
                except ValueError as err:
                    bad[i] = ValidationError("candidates", f"the model cannot take this request: {err}")
            if not bad:
                log.exception("decode failed; returning the listed order")
                return [_fallback(self.engine, r, "decode_error") for r in requests]
            good = [i for i in range(len(requests)) if i not in bad]
            done = dict(zip(good, self._rerank_isolating([preps[i] for i in good]))) if good else {}
            return [bad.get(i, done.get(i)) for i in range(len(requests))]
        except Exception:  # noqa: BLE001 -- the contract is an answer in the listed order, not an error
            log.exception("decode failed; returning the listed order")
            return [_fallback(self.engine, r, "decode_error") for r in requests]

    def warm_up(self) -> None:
        """One tiny decode per available decoder (first forward passes allocate and compile), on
        decode worker 0 with its thread share."""
        self._share_threads()
        sids = getattr(self.engine, "sids", None)
        items = list(sids.item_ids[:2]) if sids is not None else []
        if not items:
            return
        decoders = ["ar"] + (["diffusion"] if self.diffusion_available else [])
        for decoder in decoders:  # with the default settings, so the default path is the warm one
            self.engine.rerank([RerankRequest(history=items[:1], candidates=items, scores=[0.0] * len(items))],
                               replace(self.defaults, decoder=decoder,
                                       max_new_tokens=min(8, self.limits.max_new_tokens)))

    # ---- event loop ------------------------------------------------------------------------
    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    @contextlib.contextmanager
    def _tracked(self):
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _admit(self, context) -> Admission:
        """A place in the bounded queue, or the call ends here: UNAVAILABLE while draining,
        RESOURCE_EXHAUSTED when full. Nothing has been done for the request yet."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica")
        try:
            return self.batcher.admit()
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BatcherClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def _render(self, prep: Prepared, context) -> None:
        """The prompt, rendered here so a request that does not fit the model's context is answered
        INVALID_ARGUMENT (naming the limit) instead of failing its batch on the decode thread."""
        render = getattr(self.engine, "prompt_ids", None)
        if render is None:
            return
        try:
            prep.prompt_ids = await asyncio.get_running_loop().run_in_executor(
                self._render_pool, render, prep.request, prep.options.max_new_tokens)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"candidates: the model cannot take this request: {e}")

    async def _run(self, prep: Prepared, context, admission: Admission) -> pb.RerankResponse:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was queued")
        try:
            submit = self.batcher.submit(prep, prep.batch_key, admission,
                                         limit=self.decoder_max_batch.get(prep.options.decoder))
            outcome = await (asyncio.wait_for(submit, remaining) if remaining is not None else submit)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "deadline passed while the request was queued or decoding; its work was dropped")
        except BatcherClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        value = outcome.value
        if isinstance(value, ValidationError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(value))
        if isinstance(value, BaseException):
            await context.abort(grpc.StatusCode.INTERNAL, f"re-ranking failed: {value!r}")
        return build_response(prep, value, outcome.queue_ms, outcome.decode_ms, outcome.batch_size)

    async def _observed(self, method: str, context, handler):
        """Run a handler, counting its status code and latency (metrics.py)."""
        t0 = time.perf_counter()
        code = "OK"
        try:
            return await handler
        except BaseException:
            code = _status_name(context.code()) or ("CANCELLED" if context.cancelled() else "UNKNOWN")
            raise
        finally:
            self.metrics.observe_request(method, code, time.perf_counter() - t0)

    async def Rerank(self, request, context):
        return await self._observed("Rerank", context, self._rerank(request, context))

    async def Recommend(self, request, context):
        return await self._observed("Recommend", context, self._recommend(request, context))

    async def _rerank(self, request, context):
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        with await self._admit(context) as admission, self._tracked():
            try:
                prep = validate_rerank(request, self.engine.known, self.limits, self.diffusion_available,
                                       self.defaults, needs_scores=self._needs_scores)
            except ValidationError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            await self._render(prep, context)
            return await self._run(prep, context, admission)

    async def _recommend(self, request, context):
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        if self.retriever is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "Recommend needs retrieval artifacts; start the server with --retrieval DIR")
        # admission before retrieval: a refusal on a full queue costs no retrieval
        with await self._admit(context) as admission, self._tracked():
            t0 = time.perf_counter()
            try:
                history, truncated, n = self._validate_recommend(request)
                items, scores = await asyncio.get_running_loop().run_in_executor(
                    self._retrieve_pool, self.retriever.retrieve, history, n, self._allowed_rows())
                if not items:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                        "the retriever found no candidate the model can rank")
                # the retrieved list goes through exactly the checks a Rerank request gets
                rerank = pb.RerankRequest(user_id=request.user_id, history=history, options=request.options,
                                          candidates=[pb.Candidate(item_id=i, score=s) for i, s in zip(items, scores)])
                prep = validate_rerank(rerank, self.engine.known, self.limits, self.diffusion_available,
                                       self.defaults, history_len=len(request.history))
            except ValidationError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            prep.history_truncated = truncated
            await self._render(prep, context)
            retrieval_ms = (time.perf_counter() - t0) * 1000.0
            result = await self._run(prep, context, admission)
            return pb.RecommendResponse(result=result, retrieval_ms=retrieval_ms)

    def _validate_recommend(self, request) -> tuple[list[str], bool, int]:
        """(history kept, history truncated, number to retrieve), or a ValidationError."""
        size = request.ByteSize()
        if size > self.limits.max_message_bytes:
            raise ValidationError("request", f"{size} bytes; at most {self.limits.max_message_bytes}")
        if len(request.user_id) > self.limits.max_item_id_chars:
            raise ValidationError("user_id", f"{len(request.user_id)} characters; at most "
                                             f"{self.limits.max_item_id_chars}")
        n = request.num_candidates or min(self.limits.recommend_candidates, self.limits.max_candidates)
        if n > self.limits.max_candidates:
            raise ValidationError("num_candidates", f"{n}; at most {self.limits.max_candidates}")
        history, truncated = truncate_history(request.history, self.limits)
        if not history:
            raise ValidationError("history", "empty; Recommend retrieves from the user's history")
        if not any(self.retriever.known(h) for h in history):
            raise ValidationError("history", f"none of the {len(history)} items is known to the retriever")
        validate_options(request.options, self.limits, self.diffusion_available, n, self.defaults)
        return history, truncated, n

    def _allowed_rows(self):
        if self._allowed is None:  # computed once: the catalogs do not change while serving
            self._allowed = self.retriever.allowed_mask(self.engine.known)
        return self._allowed


@dataclass
class RunningServer:
    server: grpc.aio.Server
    service: RerankerService
    host: str
    port: int
    config: ServerConfig

    @property
    def address(self) -> str:
        return _address(self.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (None: off)."""
        return self.service.metrics.port

    async def warm_up(self, freeze_heap: bool = False) -> None:
        """Warm the model on the decode thread, then report SERVING. freeze_heap (the process entry
        point's choice: it is process-wide) takes what is loaded by then out of the garbage
        collector's full collections (freeze_loaded_heap)."""
        if self.config.warmup:
            t0 = time.perf_counter()
            await self.service.batcher.run_in_worker(self.service.warm_up)
            log.info("warm-up took %.1f s", time.perf_counter() - t0)
        if freeze_heap:
            freeze_loaded_heap()
        if not self.service.draining:
            await self.service.set_serving(True)
            log.info("SERVING on %s", self.address)

    async def drain(self, grace_s: float | None = None) -> None:
        """Graceful drain (the SIGTERM handler calls this): NOT_SERVING, refuse new calls, let the
        in-flight ones finish within grace_s, then stop the server."""
        svc = self.service
        if svc.draining:
            return
        svc.draining = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        await svc.health.enter_graceful_shutdown()  # NOT_SERVING everywhere, and it stays so
        log.info("draining: %d request(s) in flight, up to %.0f s", svc._active, grace)
        end = time.monotonic() + grace
        try:
            await asyncio.wait_for(svc._idle.wait(), grace)
            # Every handler returned; their answers may still be on the way out. gRPC's stop returns
            # once they are sent, so the wait is bounded by what is left of the grace (at least
            # SEND_GRACE_S), not spent.
            stop_grace = max(SEND_GRACE_S, end - time.monotonic())
        except asyncio.TimeoutError:
            log.warning("drain grace of %.1f s passed with %d request(s) still in flight", grace, svc._active)
            # The in-flight calls had their grace: cancel them now (their callers leaving lets the
            # decode thread abandon its batch).
            stop_grace = CANCEL_GRACE_S
        # /metrics stops meanwhile (its shutdown polls every 0.5 s)
        await asyncio.gather(self.server.stop(grace=stop_grace), asyncio.to_thread(svc.metrics.close))
        await svc.batcher.close()
        svc._render_pool.shutdown(wait=False, cancel_futures=True)
        svc._retrieve_pool.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def _status_name(code) -> str | None:
    """A grpc.StatusCode (or its integer value, as grpc.aio's context.code() may give) by name."""
    if isinstance(code, grpc.StatusCode):
        return code.name
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return None


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class UndecodableRequest:
    """What the service's deserializers return for bytes that are not the method's message: the
    handler answers INVALID_ARGUMENT. grpc's own path for a deserializer that raises logs a full
    traceback per request and answers with an internal class name."""

    def __init__(self, message: str, error: Exception):
        self.detail = f"request: the bytes are not a valid {message} message ({error})"


def _tolerant_parser(message_cls):
    from google.protobuf.message import DecodeError

    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as e:
            return UndecodableRequest(message_cls.DESCRIPTOR.full_name, e)
    return parse


def add_reranker_service(service, server) -> None:
    """The generated `add_RerankerServicer_to_server`, with deserializers that never raise."""
    handlers = {
        "Rerank": grpc.unary_unary_rpc_method_handler(
            service.Rerank, request_deserializer=_tolerant_parser(pb.RerankRequest),
            response_serializer=pb.RerankResponse.SerializeToString),
        "Recommend": grpc.unary_unary_rpc_method_handler(
            service.Recommend, request_deserializer=_tolerant_parser(pb.RecommendRequest),
            response_serializer=pb.RecommendResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def start_server(engine, config: ServerConfig | None = None, retriever=None) -> RunningServer:
    """Bind and start (health NOT_SERVING); call `warm_up()` on the result to become SERVING."""
    config = config or ServerConfig()
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key (PEM files)")
    limit = config.limits.max_message_bytes * TRANSPORT_HEADROOM
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
    ])
    service = RerankerService(engine, config.limits, retriever, config.max_batch, config.max_wait_ms,
                              config.max_queue, config.decoder_max_batch, config.decode_workers,
                              config.decode_threads)
    add_reranker_service(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await service.set_serving(False)
    address = _address(config.host, config.port)
    if config.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        if not _is_loopback(config.host):
            log.warning("serving plaintext on non-loopback address %s; use --tls-cert/--tls-key", config.host)
        port = server.add_insecure_port(address)
    if not port:
        raise RuntimeError(f"could not bind {address} (port in use or address not local)")
    if config.metrics_port:
        service.metrics.serve(config.host, config.metrics_port)
        log.info("Prometheus metrics on http://%s/metrics", _address(config.host, service.metrics.port))
    service.batcher.start()
    await server.start()
    log.info("listening on %s (%s), NOT_SERVING until warmed up", _address(config.host, port),
             "TLS" if config.tls_cert else "plaintext")
    return RunningServer(server, service, config.host, port, config)


def freeze_loaded_heap() -> int:
    """Move every object alive now (the model, tokenizer, RecBole and faiss modules: about half a
    million on Beauty) out of the garbage collector's reach; returns how many. A full collection
    walks them all and holds the GIL meanwhile: about 240 ms on Beauty, during which the event loop
    answers nothing; a Recommend overload that met one had refusal p99 214 ms instead of 5 ms
    (docs/EXPERIMENTS.md). After the freeze a full collection walks only what serving allocated.
    Collected first, so no garbage is frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("froze %d loaded objects out of the garbage collector's full collections", n)
    return n


async def run_until_signalled(engine, config: ServerConfig, retriever=None) -> None:
    running = await start_server(engine, config, retriever)
    loop = asyncio.get_running_loop()
    drains: list[asyncio.Task] = []

    def on_signal(sig):
        log.info("%s: draining", signal.Signals(sig).name)
        drains.append(loop.create_task(running.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await running.warm_up(freeze_heap=True)  # this process serves and nothing else: freeze what it loaded
    await running.wait()
    # the server stops inside drain(); let drain finish its own cleanup before the loop closes
    await asyncio.gather(*drains)


class BackgroundServer:
    """A server on its own event loop in a daemon thread, for synchronous callers (tests,
    benchmarks, notebooks). `stop()` drains it like SIGTERM would."""

    def __init__(self, engine, config: ServerConfig | None = None, retriever=None, warm_up: bool = True,
                 timeout: float = 120.0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio-server", daemon=True)
        self.thread.start()
        try:
            self.running: RunningServer = self.call(start_server(engine, config, retriever), timeout)
        except BaseException:
            self._close_loop()
            raise
        self.warmed = self.submit(self.running.warm_up()) if warm_up else None

    @property
    def service(self) -> RerankerService:
        return self.running.service

    @property
    def target(self) -> str:
        return self.running.address

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the server's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float = 120.0):
        return self.submit(coro).result(timeout)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.call(self.running.drain(grace_s), grace_s + 30.0)
        self._close_loop()

    def _close_loop(self) -> None:
        async def cancel_rest():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.call(cancel_rest(), 30.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30.0)
        self.loop.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def pin_torch_threads(n: int) -> None:
    """Run this thread's torch ops on n threads. torch sets a thread's count from the process-wide
    default at the thread's first parallel op, overwriting an earlier set_num_threads on that thread
    (and set_num_threads also moves that default): get_num_threads does that first-op setup now, so
    the n set after it stays."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def serve(model_dir, data_dir, retrieval_dir=None, host: str = "127.0.0.1", port: int = 50051, max_batch: int = 8,
          max_wait_ms: float = 5.0, max_queue: int = 64, tls_cert=None, tls_key=None, device: str = "cpu",
          drain_grace_s: float = 30.0, limits: ServiceLimits | None = None, metrics_port: int = 0,
          exit_process: bool = True, decoder_max_batch: dict | None = None, decode_workers: int = 1) -> int:
    """Load the engine (and the retriever, if given) and serve until SIGTERM/SIGINT, then end the
    process (exit_process) or return 0.

    Ending the process at once, after flushing the logs, is what keeps the exit within the drain
    grace: interpreter teardown would wait for a decode still running on the worker thread and
    unload torch and its peers, seconds after "stopped"."""
    from ..engine import RerankEngine

    config = ServerConfig(host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue,
                          tls_cert=str(tls_cert) if tls_cert else None, tls_key=str(tls_key) if tls_key else None,
                          drain_grace_s=drain_grace_s, metrics_port=metrics_port, limits=limits or ServiceLimits(),
                          decoder_max_batch=dict(decoder_max_batch or {}), decode_workers=decode_workers)
    config.decode_threads = config.decode_threads or torch.get_num_threads()
    log.info("%d decode worker(s) sharing %d torch thread(s): a batch decoding alone gets all of them",
             config.decode_workers, config.decode_threads)
    # From here on only decode worker 0 runs multi-threaded ops (RerankerService._share_threads): the
    # loads and the event loop on this thread, and every thread that does not set its own, run on one.
    pin_torch_threads(1)
    t0 = time.perf_counter()
    engine = RerankEngine.load(model_dir, data_dir, device)
    retriever = None
    if retrieval_dir:
        from .retrieval import Retriever  # RecBole + faiss: imported only when Recommend is wanted

        retriever = Retriever.load(retrieval_dir, device)
    log.info("loaded the model%s in %.1f s", " and the retriever" if retriever else "", time.perf_counter() - t0)
    asyncio.run(run_until_signalled(engine, config, retriever))
    if exit_process:
        _exit_now(0)
    return 0


def _exit_now(code: int) -> None:
    """Flush what was logged and printed, then end the process without interpreter teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def serve_from_args(args: argparse.Namespace) -> int:
    from ..decoding import explicit_from_args

    decode = explicit_from_args(args, SERVER_DECODE_FLAGS)  # --max-new-tokens is a limit here, not a setting
    limits = ServiceLimits(max_candidates=args.max_candidates, max_history=args.max_history,
                           max_message_bytes=args.max_message_bytes, max_new_tokens=args.max_new_tokens,
                           recommend_candidates=args.recommend_candidates, decode=decode)
    return serve(args.model, args.data, args.retrieval, args.host, args.port, args.max_batch, args.max_wait_ms,
                 args.max_queue, args.tls_cert, args.tls_key, args.device, args.drain_grace_s, limits,
                 metrics_port=args.metrics_port, decoder_max_batch=args.decoder_max_batch,
                 decode_workers=args.decode_workers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reranker.service.server", description=__doc__.split("\n")[0])
    add_serve_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss").setLevel(logging.WARNING)  # its loader logs every CPU-feature probe
    try:
        return serve_from_args(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
