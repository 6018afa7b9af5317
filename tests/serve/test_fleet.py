"""``verl serve --replicas 2``: the service as Ray Serve replicas with one control plane (issue 27; slow: a real
local Ray cluster started by the CLI, as docs/serving.md says).

One scenario, in order, under a steady stream of completions:

1. a promote (load model ``b``, give it the whole default route) reaches every replica: 20 state reads on fresh
   connections, answered by both replicas, all show the new version and route, and responses carry it in
   ``X-Verl-Config-Version`` (the split-brain of ``uvicorn --workers 2`` is gone);
2. a change one replica cannot make (a model path that does not exist) is rolled back everywhere, the 409 naming
   every replica that did not follow, and the version in force does not move;
3. SIGKILL one replica: Ray Serve replaces it, the replacement joins at the current version (model ``b`` loaded, the
   promoted route), and the load loses at most the requests that replica had in flight;
4. SIGKILL the control-plane actor: the routes in force stay in force, and the restarted actor resumes from its
   state file (the next change gets the next version, not version 2);
5. one record log and one metrics page for the fleet; users' feedback accepted on any replica for any replica's
   answer, once per answer and source.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pyarrow.parquet as pq
import pytest

from tests.ports import free_port
from tests.serve.helpers import REPO, BackgroundClients, make_lora_adapters, replica_states

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.serial]  # Ray, timed load

ADMIN = {"Authorization": "Bearer fleet-admin"}


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = condition()
            if last:
                return last
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


def state(url: str) -> dict:
    with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as client:  # a fresh connection: any replica
        return client.get("/admin/state").json()


def verl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VERL_SERVE_ADMIN_API_KEY": "fleet-admin"}
    return subprocess.run([sys.executable, "-m", "verl.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


class Load(BackgroundClients):
    """Two clients sending completions until stopped; failures kept with their status."""

    def __init__(self, url: str):
        super().__init__(url, 2)
        self.ok = 0

    def client(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                with httpx.Client(base_url=self.url, timeout=60) as client:
                    reply = client.post("/v1/completions", json={"prompt": "12+7=", "max_tokens": 4})
                if reply.status_code == 200:
                    self.ok += 1
                else:
                    self.failures.append(reply.status_code)
            except httpx.HTTPError as exc:
                self.failures.append(type(exc).__name__)


def control_plane_process() -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        if "ray::ControlPlane" in " ".join(proc.info["cmdline"] or []):
            return proc
    raise AssertionError("no control-plane process")


@pytest.mark.budget(115)  # step 8 (the open loop from two processes) ~25 s
def test_two_replicas_follow_one_control_plane_through_promotes_and_kills(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    records_path = tmp_path / "records.jsonl"
    env = {**os.environ, "VERL_SERVE_ADMIN_API_KEY": "fleet-admin", "VERL_SERVE_STATE_PATH": str(tmp_path / "s.json"),
           "VERL_SERVE_RECORDS_PATH": str(records_path), "VERL_SERVE_RECORD_TEXTS": "true", "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "verl.cli", "serve", "--replicas", "2", "--port", str(port)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = wait_for(lambda: (h := httpx.get(url + "/health", timeout=5).json())["replicas"] == 2 and h, 240,
                          "two live replicas")
        assert health["status"] == "ok" and health["replica_versions"] == [1]
        with Load(url) as load:
            # 1. A promote reaches every replica.
            promoted = verl("promote", "--service", url, "--model", "b", "--path", "builtin:tiny-arith",
                            "--weight", "1.0")
            assert promoted.returncode == 0, promoted.stderr
            reads = replica_states(url, ADMIN, key=lambda r: r["process"]["pid"])
            version = reads[0]["version"]
            assert version == 3  # one change loads b, one moves the route
            assert {r["process"]["pid"] for r in reads} and len({r["process"]["pid"] for r in reads}) == 2
            assert all(r["version"] == version and r["routes"]["default"] == {"b": 1.0} for r in reads)
            reply = httpx.post(url + "/v1/completions", json={"prompt": "3*4=", "max_tokens": 4}, timeout=60)
            assert reply.headers["x-verl-config-version"] == str(version) and reply.json()["model"] == "b"

            # 2. A change no replica can make is rolled back everywhere, naming them.
            bad = verl("promote", "--service", url, "--model", "c", "--path", str(tmp_path / "missing"))
            assert bad.returncode == 1 and "rolled back, serving version 3" in bad.stderr, bad.stderr
            assert bad.stderr.count("prepare failed") == 1 and bad.stderr.count("no such directory") == 2
            assert state(url)["version"] == 3 and [m["name"] for m in state(url)["models"]][-1] == "b"

            # 3. SIGKILL one replica: Ray Serve replaces it, at the current version.
            victim = reads[0]["process"]["pid"]
            failures_before = len(load.failures)
            os.kill(victim, signal.SIGKILL)
            fresh = wait_for(lambda: next((s for s in (state(url) for _ in range(6))
                                           if s["process"]["pid"] not in {r["process"]["pid"] for r in reads}), None),
                             240, "a replacement replica")
            assert fresh["version"] == 3 and fresh["routes"]["default"] == {"b": 1.0}
            assert "b" in [m["name"] for m in fresh["models"]]
            wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["replica_versions"] == [3], 60,
                     "both replicas at version 3")
            lost = len(load.failures) - failures_before
            assert lost <= 2, load.failures  # at most what the dead replica had in flight (two clients)

            # 4. SIGKILL the control plane: routes in force stay, and it comes back from its state file.
            control_plane_process().kill()
            time.sleep(2)
            assert all(state(url)["routes"]["default"] == {"b": 1.0} for _ in range(4))
            wait_for(lambda: (r := verl("promote", "--service", url, "--model", "tiny-arith", "--weight",
                                        "0.5")).returncode == 0 and r, 120,
                     "a promote after the control plane restarted")
            after = [state(url) for _ in range(10)]
            assert all(s["version"] == 4 and s["routes"]["default"] == {"b": 0.5, "tiny-arith": 0.5} for s in after)

            # 4b. vLLM's weight endpoints on the fleet, under the same load: pause (keep), new weights for b, resume
            # reach both replicas (the one that replaced the killed replica too) through the restarted control
            # plane, as versions 5-7; no request fails, and both replicas' records show b's new weight version.
            # Weights that fit no replica are refused on every one and change nothing; an adapter loaded with
            # /v1/load_lora_adapter answers under its name on both, and its in-place reload moves its version.
            failures_before = len(load.failures)
            for path, body in (("/pause?mode=keep", None),
                               ("/update_weights", {"update_info": {"path": str(REPO / "verl/models/assets/tiny-arith"),
                                                                    "model": "b", "version": 11}}),
                               ("/resume", None)):
                changed = httpx.post(url + path, headers=ADMIN, json=body, timeout=120)
                assert changed.status_code == 200, (path, changed.text)
            assert changed.json() == {"status": "resumed"}
            reads = replica_states(url, ADMIN, key=lambda r: r["process"]["pid"])
            assert {r["version"] for r in reads} == {7}
            assert all({m["name"]: m["weight_version"] for m in r["models"]}["b"] == 11 for r in reads), reads
            misfit = httpx.post(url + "/update_weights", headers=ADMIN, timeout=120, json={"update_info": {
                "path": str(REPO / "verl/models/assets/tiny-agent"), "model": "b"}})
            assert misfit.status_code == 409 and misfit.text.count("does not fit the served model") == 2, misfit.text
            assert "prepare failed" in misfit.text and state(url)["version"] == 7
            adapters = make_lora_adapters(tmp_path / "lora", names=("first", "second"))
            loaded = httpx.post(url + "/v1/load_lora_adapter", headers=ADMIN, timeout=120,
                                json={"lora_name": "live", "lora_path": adapters["first"]})
            assert loaded.status_code == 200 and "added successfully" in loaded.text, loaded.text
            reloaded = httpx.post(url + "/v1/load_lora_adapter", headers=ADMIN, timeout=120,
                                  json={"lora_name": "live", "lora_path": adapters["second"], "load_inplace": True})
            assert reloaded.status_code == 200 and "reloaded in place" in reloaded.text, reloaded.text
            reads = replica_states(url, ADMIN, key=lambda r: r["process"]["pid"])
            assert all({m["name"]: m["weight_version"] for m in r["models"]}["live"] == 1 for r in reads), reads
            named = [httpx.post(url + "/v1/completions", timeout=60, json={"model": "live", "prompt": "3+4=",
                                                                          "max_tokens": 4}) for _ in range(4)]
            assert all(r.status_code == 200 and r.headers["x-verl-weight-version"] == "1" for r in named)

            def new_weights_on_both() -> bool:
                with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as client:
                    rows = client.get("/admin/records").json()["records"]
                return len({r["replica"] for r in rows if r["model"] == "b" and r["weight_version"] == 11}) == 2

            wait_for(new_weights_on_both, 90, "b's records at weight version 11 from both replicas")
            assert len(load.failures) == failures_before, load.failures[failures_before:]
        print(f"fleet: {load.ok} requests answered, failed: {load.failures} (replica kill lost {lost})")
        assert load.ok > 20 and len(load.failures) <= 2, load.failures
        # 5. One record log for the fleet: any replica's /admin/records and records_path hold every replica's rows
        # (those of the killed replica's last poll interval aside).
        time.sleep(1.5)
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as client:
            rows = client.get("/admin/records").json()["records"]
        answered = [r for r in rows if r["error"] is None]
        assert len({r["replica"] for r in rows}) >= 2
        assert load.ok * 0.9 <= len(answered) <= load.ok + 10, (len(answered), load.ok)
        assert len(records_path.read_text().splitlines()) == len(rows)

        # 5b. Feedback on any replica for any replica's answer, once per answer and source for the whole fleet
        # (the control plane decides); an answer given a moment ago is found too (its row may still be on its way).
        by_replica = {}
        for row in answered:
            by_replica.setdefault(row["replica"], row["id"])
        just_answered = httpx.post(url + "/v1/completions", json={"prompt": "2+5=", "max_tokens": 4}, timeout=60)
        fresh_id = just_answered.json()["id"]
        targets = [*by_replica.values(), fresh_id]
        for attempt in range(2):
            for completion_id in targets:
                with httpx.Client(base_url=url, timeout=30) as client:  # a fresh connection: any replica
                    given = client.post("/v1/feedback", json={"id": completion_id, "thumbs": "up"})
                assert given.status_code == 200 and given.json()["duplicate"] is (attempt == 1), given.text
        assert httpx.post(url + "/v1/feedback", json={"id": "cmpl-none", "score": 1}, timeout=30).status_code == 404
        time.sleep(0.5)
        with httpx.Client(base_url=url, headers=ADMIN, timeout=30) as client:
            late = [r for r in client.get("/admin/records").json()["records"] if r["kind"] == "reward"]
        assert sorted(r["id"] for r in late) == sorted(targets) and {r["reward_source"] for r in late} == {"feedback"}

        # 5c. Not for training, across the fleet: chat requests on fresh connections, every other one flagged by
        # the client, until both replicas answered a flagged one; the merged records file exports the unflagged
        # ones and never a flagged one.
        asked: dict[bool, set[str]] = {True: set(), False: set()}

        def recorded() -> list[dict]:  # complete lines only: the control plane may be appending one right now
            return [json.loads(line) for line in records_path.read_text().splitlines(keepends=True)
                    if line.endswith("\n")]

        def ask(k: int) -> tuple[bool, str]:
            body = {"messages": [{"role": "user", "content": f"What is {k}+{k + 11}?"}], "max_tokens": 6,
                    "user": f"user-{k}", **({"verl": {"not_for_training": True}} if k % 2 else {})}
            with httpx.Client(base_url=url, timeout=60) as client:
                answered_chat = client.post("/v1/chat/completions", json=body)
            assert answered_chat.status_code == 200, answered_chat.text
            return bool(k % 2), answered_chat.json()["id"]

        for batch in range(4):
            # Eight at once: one request at a time on an idle fleet can go to the same replica every time (Ray
            # Serve's router picks the shorter queue; a run sent all 16 flagged ones to one replica).
            with ThreadPoolExecutor(8) as pool:
                for flagged, completion_id in pool.map(ask, range(8 * batch, 8 * batch + 8)):
                    asked[flagged].add(completion_id)
            wait_for(lambda: asked[True] | asked[False] <= {r["id"] for r in recorded()}, 90,
                     "the chat requests' rows in the merged records file")
            if len({r["replica"] for r in recorded() if r["id"] in asked[True]}) == 2:
                break
        assert len({r["replica"] for r in recorded() if r["id"] in asked[True]}) == 2
        exported = verl("data", "from-records", str(records_path), "--out", str(tmp_path / "export"),
                        "--val-fraction", "0", "--min-rewards", "0")
        assert exported.returncode == 0, exported.stderr
        summary = json.loads((tmp_path / "export" / "summary.json").read_text())
        assert summary["counts"]["not_for_training"] == len(asked[True])
        train = pq.read_table(tmp_path / "export" / "train.parquet").to_pylist()
        assert {c for r in train for c in r["extra_info"]["completion_ids"]} == asked[False]

        # 6. One metrics page for the fleet: every live replica's series, labelled replica (name = pid-suffix).
        page = httpx.get(url + "/metrics", timeout=30).text
        labelled = {line.split('replica="')[1].split('"')[0] for line in page.splitlines()
                    if line.startswith("verl:server_info{")}
        pids = {s["process"]["pid"] for s in (state(url) for _ in range(8))}
        assert len(labelled) == 2 and {int(name.split("-")[0]) for name in labelled} >= pids, (labelled, pids)

        # 7. verl loadtest against the deployment, load from two Locust processes: counts equal Locust's, the
        # per-replica line knows there are 2 replicas, and the fleet's merged /metrics cross-checks this run.
        out = tmp_path / "loadtest"
        run = verl("loadtest", "--url", url, "--processes", "2", "--out", str(out), "--step-users", "2",
                   "--step-time", "8", "--step-settle", "3", "--slo-p95-ms", "60000", "--target-rps", "100",
                   "--locust-arg=--num-prompts=16", "--quiet")
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads((out / "capacity_report.json").read_text())
        totals, cap = report["totals"], report["capacity"]
        assert totals["locust_aggregated_requests"] == totals["http_requests"] + totals["llm_entries"]
        assert totals["http_requests"] == totals["steps_requests"] > 0
        assert cap["replicas_tested"] == 2 and "measured on 2 replicas" in run.stderr
        served = sum(report["server"]["http_requests"].get(p, {}).get("200", 0)
                     for p in ("/generate", "/v1/completions", "/v1/chat/completions"))
        ok = totals["http_requests"] - totals["http_failures"]
        assert ok <= served <= ok + 2, (ok, served)

        # 8. The open loop on the fleet from two Locust processes: each sends every other arrival of one schedule,
        # their records merge into the whole schedule, and Locust's count (the workers' last reports included)
        # equals it. On 2 cores shared with 2 replicas the generator's lag is reported, not enforced.
        from loadtest.open_loop import arrival_offsets

        out = tmp_path / "open"
        run = verl("loadtest", "--url", url, "--rate", "6", "--duration", "8", "--processes", "2", "--out", str(out),
                   "--max-lag-p99-ms", "5000", "--locust-arg=--num-prompts=16", "--quiet")
        assert run.returncode == 0, run.stderr[-3000:]
        results = json.loads((out / "open_loop.json").read_text())
        scheduled = len(arrival_offsets(6, 8.0, "poisson", 1.0, 0))
        records = [json.loads(line) for line in (out / "open_6_requests.jsonl").read_text().splitlines()]
        assert len(records) == scheduled and all(r["status"] == 200 for r in records)
        assert [r["scheduled_s"] for r in records] == sorted(r["scheduled_s"] for r in records)
        assert not list(out.glob("*.w*.jsonl"))  # the workers' parts were merged
        only = results["runs"][0]
        assert results["processes"] == 2 and only["replicas"] == 2 and only["completed"] == scheduled
        assert only["schedule_lag_p99_ms"] is not None and "2 Locust processes" in (out / "open_loop.md").read_text()
        stats = (out / "open_6_stats.csv").read_text().splitlines()
        assert any(line.startswith("POST,/v1/chat/completions [open loop],") and
                   line.split(",")[2] == str(scheduled) for line in stats), stats
    finally:
        server.send_signal(signal.SIGINT)
        try:
            out, _ = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            out, _ = server.communicate()
        print(out[-3000:])


@pytest.mark.budget(40)
def test_replicas_on_two_ray_nodes_started_with_ray_start(tmp_path):
    """Item 6: a head and a worker node started with ``ray start`` (two raylets on this box stand in for two
    machines, one CPU each), ``verl serve --replicas 2 --ray-address``: one replica lands on each node, and a promote
    reaches both."""
    ray_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    ray_bin = str(Path(sys.executable).parent / "ray")  # the ray CLI of this environment
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    # Ray 2.60's `ray start` authenticates nodes with a token (~/.ray/auth_token): every process of the cluster,
    # verl serve included, runs with RAY_AUTH_MODE=token (docs/serving.md).
    # Ray Serve's proxy prefers replicas on its own node while they have room; off, so both nodes take requests.
    env = {**os.environ, "VERL_SERVE_ADMIN_API_KEY": "fleet-admin", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "token",
           "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}
    subprocess.run([ray_bin, "start", "--head", "--port", str(ray_port), "--include-dashboard=false", *common],
                   check=True, capture_output=True, env=env, timeout=180)
    server = None
    try:
        subprocess.run([ray_bin, "start", "--address", f"127.0.0.1:{ray_port}", *common], check=True,
                       capture_output=True, env=env, timeout=180)
        server = subprocess.Popen([sys.executable, "-m", "verl.cli", "serve", "--replicas", "2", "--port", str(port),
                                   "--ray-address", f"127.0.0.1:{ray_port}"], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: httpx.get(url + "/health", timeout=5).json()["replicas"] == 2, 240, "two live replicas")
        reads = replica_states(url, ADMIN, key=lambda r: r["process"]["node"])
        seen = sorted({(r["process"]["node"][:8], r["process"]["pid"]) for r in reads})
        assert len({node for node, _ in seen}) == 2, f"{len(reads)} reads answered by (node, pid) {seen}"
        promoted = verl("promote", "--service", url, "--model", "b", "--path", "builtin:tiny-arith", "--weight", "1.0")
        assert promoted.returncode == 0, promoted.stderr
        after = replica_states(url, ADMIN, key=lambda r: r["process"]["node"])
        assert len({r["process"]["node"] for r in after}) == 2
        assert all(r["version"] == 3 and r["routes"]["default"] == {"b": 1.0} for r in after)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            try:
                server.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)


@pytest.mark.budget(85)
def test_readme_fleet_block_runs_as_written(tmp_path):
    """README's "Serving on several replicas" commands, as written: only the port, the server's lifetime (wait
    for two replicas, stop at the end) and the load test's step length (8 s, not 20: the steps' lengths are not what
    it checks) are adapted to a test."""
    from tests.serve.test_readme_canary import readme_block

    script = readme_block("### Serving on several replicas")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = script.replace("http://127.0.0.1:8000", url)
    serve_line = "verl serve --replicas 2 &"
    assert serve_line in script
    script = script.replace(serve_line, (
        f"verl serve --replicas 2 --port {port} > serve.log 2>&1 & SERVER=$!\n"
        "trap 'kill -INT $SERVER; wait $SERVER' EXIT\n"
        f"for i in $(seq 240); do curl -s {url}/health | grep -q '\"replicas\":2' && break; sleep 1; done"))
    assert script.count("--step-time 20") == 1
    script = script.replace("--step-time 20", "--step-time 8")
    bin_dir = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    log = (tmp_path / "serve.log").read_text()
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:], log[-3000:])
    out = result.stdout
    assert '"replicas":2' in out and '"replica_versions":[1]' in out
    assert "x-verl-config-version: 3" in out.lower()
    assert len({line.split('replica="')[1].split('"')[0] for line in out.splitlines()
                if line.startswith("verl:server_info{")}) == 2
    report = json.loads((tmp_path / "outputs/loadtest/capacity_report.json").read_text())
    assert [s["users"] for s in report["steps"]] == [2, 4] and report["capacity"]["replicas_tested"] == 2
    assert "measured on 2 replicas" in result.stderr and "100 requests/s needs" in result.stderr
