"""Overload, disconnects, timeouts, API keys, engine failure and graceful shutdown, on real servers."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from tests.serve.helpers import metric_value, run_server, run_server_process, wait_healthy

pytestmark = pytest.mark.e2e  # a real process, server, cluster or trainer run: `make test-fast` skips it

LONG = {"prompt": "<|user|>What is 1+1?\n<|assistant|>", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
# The 25M-parameter random model takes ~20 ms a token here: a 120-token request lasts seconds, so a client can
# drop out (or a timeout fire) long before it would finish, however loaded the machine is.
SLOW = {"model": "builtin:small-arith-base"}


def _running(url: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, "verl:num_requests_running")


def test_overload_gets_429_with_retry_after_and_the_server_stays_healthy():
    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=LONG) for _ in range(12)])

    # 2 in the batch + 2 waiting = 4 sequences admitted; the other 8 of a 12-request burst are refused.
    with run_server(max_batch_size=2, max_queue_size=2, retry_after_s=3) as srv:
        responses = asyncio.run(burst(srv.url))
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["Retry-After"] == "3"
        assert refused.json()["error"]["code"] == "queue_full"
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200  # capacity comes back once the burst is served
        text = httpx.get(srv.url + "/metrics").text
        assert metric_value(text, "verl:requests_rejected_total", reason="queue_full") == codes.count(429)
        assert metric_value(text, "verl:http_requests_total", path="/v1/completions", status="429") == codes.count(429)


def test_dropped_stream_frees_its_slot():
    # One batch slot and no queue: while the abandoned stream held its slot, every other request would get 429.
    with run_server(max_batch_size=1, max_queue_size=0, **SLOW) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            assert _running(srv.url) == 1
        # Leaving the block closes the connection mid-stream (120 tokens were asked for).
        deadline = time.monotonic() + 30
        while _running(srv.url) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(srv.url) == 0
        after = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 3}, timeout=60)
        assert after.status_code == 200
        metrics = httpx.get(srv.url + "/metrics").text
        assert metric_value(metrics, "verl:request_success_total", finished_reason="abort") == 1
        assert metric_value(metrics, "verl:generation_tokens_total") < 120 + 3


def test_dropped_non_streaming_client_frees_its_slot():
    with run_server(max_batch_size=1, max_queue_size=0, **SLOW) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=0.5)
        deadline = time.monotonic() + 30
        while _running(srv.url) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=60).status_code == 200
        aborted = metric_value(httpx.get(srv.url + "/metrics").text, "verl:request_success_total",
                               finished_reason="abort")
        assert aborted == 1


def test_timeout_gives_504_and_frees_the_slot():
    with run_server(request_timeout_s=0.2, max_batch_size=1, max_queue_size=0, **SLOW) as srv:
        resp = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60)
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert '"code":"timeout"' in events[-2] and events[-1] == "data: [DONE]"
        deadline = time.monotonic() + 30
        while _running(srv.url) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(srv.url) == 0


def test_api_key_is_enforced_but_health_stays_open():
    with run_server(api_key="s3cret") as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        denied = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert denied.status_code == 401
        assert denied.headers["WWW-Authenticate"] == "Bearer"
        assert denied.json()["error"]["type"] == "authentication_error"
        wrong = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny-arith", prompt="hi", max_tokens=2).choices
        assert httpx.get(srv.url + "/generate").status_code in (401, 405)  # no key: never reaches the model
        # With a key: metrics and version need it, the docs and the schema are off, no local path is shown.
        for path in ("/metrics", "/version"):
            assert httpx.get(srv.url + path).status_code == 401, path
            assert httpx.get(srv.url + path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 404, path
        card = good.models.list().data[0]
        assert card.root == "tiny-arith" and "/" not in str(card.model_dump())


def test_metrics_public_keeps_metrics_open_with_a_key():
    with run_server(api_key="s3cret", metrics_public=True) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/version").status_code == 401


def test_cors_is_off_by_default_and_on_when_configured(server):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    resp = httpx.options(server.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in resp.headers
    with run_server(cors_allow_origins=["https://app.example"]) as srv:
        resp = httpx.options(srv.url + "/v1/completions",
                             headers={**preflight, "Origin": "https://app.example"})
        assert resp.headers["access-control-allow-origin"] == "https://app.example"


def test_engine_death_turns_health_and_requests_into_503():
    with run_server() as srv:
        engine = srv.service.lifecycle.engine

        def broken_scheduler() -> None:
            raise RuntimeError("injected fault in the engine loop itself")

        engine.steps.drop_aborted = broken_scheduler  # not one request's computation: the loop itself fails
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        again = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert again.status_code == 503


HOSTILE = [
    {"top_k": 10**29, "temperature": 1.0},  # arrives as an int beyond int64
    {"repetition_penalty": 1e-300, "temperature": 1.0},  # divides logits into inf
    {"repetition_penalty": 1e-300, "temperature": 0},
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_sampling_values_never_take_the_engine_down(path):
    with run_server() as srv:
        for extra in HOSTILE:
            body = ({"prompt": "<|user|>What is 1+1?\n<|assistant|>"} if path == "/v1/completions" else
                    {"messages": [{"role": "user", "content": "What is 1+1?"}]})
            resp = httpx.post(srv.url + path, json={**body, "max_tokens": 4, **extra}, timeout=60)
            assert resp.status_code == 200, (extra, resp.text)
            assert httpx.get(srv.url + "/health").status_code == 200
        normal = httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2, "temperature": 0},
                            timeout=60)
        assert normal.status_code == 200


def test_a_request_that_fails_alone_fails_alone_and_the_engine_goes_on():
    with run_server() as srv:
        engine = srv.service.lifecycle.engine
        real = engine.steps.sampler.sample_rows

        def poisoned(logits, seqs):  # sampling raises for any batch holding the poisoned request
            if any(seq.request.sampling.seed == 666 for seq in seqs):
                raise RuntimeError("poisoned row")
            return real(logits, seqs)

        engine.steps.sampler.sample_rows = poisoned

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                bad = {"prompt": "1+1", "max_tokens": 8, "temperature": 1.0, "seed": 666}
                good = {"prompt": "2+2", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in (bad, good, good)))

        bad, good, good2 = asyncio.run(both())
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
        assert good.status_code == good2.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8
        assert httpx.get(srv.url + "/health").status_code == 200
        # Counted per model, and the failed sequence's record names the error.
        assert metric_value(httpx.get(srv.url + "/metrics").text, "verl:request_errors_total",
                            model_name="tiny-arith") == 1
        assert [r["error"] for r in srv.service.records.snapshot() if r["error"]] == [
            "RequestFailedError: generation failed for this request: RuntimeError('poisoned row')"]


def test_a_model_that_cannot_load_reports_dead_with_the_reason(tmp_path):
    with run_server(wait=False, model=str(tmp_path / "missing")) as srv:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            body = httpx.get(srv.url + "/health").json()
            if body["status"] != "loading":
                break
            time.sleep(0.05)
        assert body["status"] == "dead" and "no such directory" in body["detail"]
        resp = httpx.post(srv.url + "/generate", json={"prompt": "hi"})
        assert resp.status_code == 503 and resp.headers["Retry-After"]


def test_sigterm_drains_in_flight_work_and_refuses_new_work():
    env = {"VERL_SERVE_MODEL": "builtin:tiny-arith", "VERL_SERVE_ENGINE": "transformers",
           "VERL_SERVE_DRAIN_GRACE_S": "3", "VERL_SERVE_SHUTDOWN_TIMEOUT_S": "20"}
    with run_server_process(env) as (url, proc):
        wait_healthy(url)
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            health = httpx.get(url + "/health")
            while health.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.02)
                health = httpx.get(url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]  # the in-flight request ran to its end
        # uvicorn re-raises the signal it handled once it has shut down cleanly, so the exit status is SIGTERM's.
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stdout.read()


def test_unencodable_text_and_odd_logit_bias_keys_are_400s_on_a_kept_alive_connection(server):
    # One client, one keep-alive connection: each bad request gets a 400 and the connection still serves.
    with httpx.Client(base_url=server.url, timeout=60) as client:
        cases = [
            ("/v1/completions", {"prompt": "1+1\ud800", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2},
             "messages.0.content"),
            ("/v1/completions", {"prompt": "1+1", "max_tokens": 2, "logit_bias": {"²": 1.0}}, "logit_bias"),
        ]
        for path, body, field in cases:
            # json.dumps escapes the surrogate as \ud800, as a client in another language would send it.
            resp = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text
            assert field in resp.json()["error"]["message"] or resp.json()["error"]["param"] == field
        several = client.post("/v1/completions", json={"prompt": "1+1", "max_tokens": 2,
                                                        "logit_bias": {"²": 1.0, "-1": 2.0, "99999": 3.0}})
        message = several.json()["error"]["message"]
        assert several.status_code == 400 and all(k in message for k in ("'²'", "'-1'", "'99999'"))
        assert client.post("/v1/completions", json={"prompt": "1+1", "max_tokens": 2}).status_code == 200


def test_body_limit_and_key_are_checked_before_the_body_is_read():
    import socket
    from urllib.parse import urlsplit

    with run_server(api_key="secret", max_body_bytes=64 * 1024) as srv:
        headers = {"Authorization": "Bearer secret"}
        big = {"prompt": "x" * 200_000, "max_tokens": 2}
        resp = httpx.post(srv.url + "/v1/completions", json=big, headers=headers, timeout=30)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

        # A declared 50 MB body without the key: refused (401) from the headers alone, nothing sent after them.
        host, port = urlsplit(srv.url).hostname, urlsplit(srv.url).port
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 52428800\r\n\r\n")
            answer = sock.recv(4096).decode().lower()
        assert answer.startswith("http/1.1 401") and "www-authenticate: bearer" in answer

        # Chunked (no Content-Length): cut off once past the limit.
        def chunks():
            for _ in range(40):
                yield b"x" * 4096

        resp = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30,
                          headers={**headers, "content-type": "application/json"})
        assert resp.status_code == 413
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2}, headers=headers)
        assert ok.status_code == 200


def test_a_huge_prompt_is_refused_by_length_without_stalling_health():
    import threading

    with run_server(max_body_bytes=16 * 1024 * 1024) as srv:
        worst = [0.0]
        done = threading.Event()

        def probe() -> None:
            while not done.is_set():
                start = time.perf_counter()
                httpx.get(srv.url + "/health", timeout=30)
                worst[0] = max(worst[0], time.perf_counter() - start)
                time.sleep(0.01)

        thread = threading.Thread(target=probe)
        thread.start()
        try:
            resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "7" * 5_000_000, "max_tokens": 2},
                              timeout=60)
        finally:
            done.set()
            thread.join()
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
        assert "characters" in resp.json()["error"]["message"]
        print(f"/health worst latency during a 5 MB prompt: {worst[0] * 1000:.0f} ms")


def _open_socket(url: str):
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=10)


def _closed_by_server(sock, within: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _read_until_closed(sock, within: float) -> str:
    """Everything the server sends until it closes the connection (fails if it does not close in time)."""
    sock.settimeout(within)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data.decode()


def test_slow_clients_are_cut_off_by_header_and_body_deadlines():
    """Half-sent headers (only `verl serve` can time those: uvicorn alone waits forever) and a stalled body (the
    app's own deadline: 408) both free their connection; the service keeps answering meanwhile."""
    with run_server(as_verl_serve=True, header_timeout_s=1.0, body_timeout_s=1.0) as srv:
        silent = [_open_socket(srv.url) for _ in range(20)]  # connect, send nothing
        partial = [_open_socket(srv.url) for _ in range(20)]
        for sock in partial:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finish
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "1+1", "max_tokens": 2}).status_code == 200
        assert all(_closed_by_server(sock, within=5) for sock in silent + partial)

        with _open_socket(srv.url) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # 11 of 100 bytes, then silence
            answer = _read_until_closed(sock, within=10)  # headers and body may come in separate segments
            assert answer.startswith("HTTP/1.1 408"), answer
            assert '"code":"request_timeout"' in answer.replace(" ", "") and "body_timeout_s" in answer
        for sock in silent + partial:
            sock.close()


def test_plain_uvicorn_still_times_out_a_stalled_body():
    """`uvicorn serve.api:app` has no header deadline, but the body deadline is the app's and holds there too."""
    with run_server(body_timeout_s=1.0) as srv, _open_socket(srv.url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 50\r\n\r\n{")
        assert _read_until_closed(sock, within=10).startswith("HTTP/1.1 408")
