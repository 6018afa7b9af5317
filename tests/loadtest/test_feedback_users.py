"""``--user-mix feedback`` under real Locust against the real service (issue 43 item 7): chats that carry no answer,
then — a delay later, while the user goes on — a thumbs up or down on the answer's id. The service records each
verdict as a reward row of source ``feedback`` beside its request; the simulated user's verdict is the rule's on
the answer the service gave (checked here from the recorded texts against the prompt file's answers)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from loadtest.prompts import load_prompts
from loadtest.run import locust_command, run_locust
from loadtest.settings import LoadTestConfig
from tests.serve.helpers import run_server
from verl.data.records import join_rewards
from verl.rewards import get_reward_fn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(170)]

PROMPTS = "builtin:arithmetic/val"


def test_feedback_users_send_no_answers_and_their_verdicts_land_beside_the_requests(tmp_path: Path) -> None:
    # One load generator is one caller: the per-key feedback limit (20/s by default) is raised for it.
    with run_server(record_texts=True, feedback_rate_limit=1000.0, feedback_burst=1000) as srv:
        config = LoadTestConfig(out_dir=tmp_path, step_users="2", step_time_s=8, step_settle_s=1, user_mix="feedback",
                                max_tokens=8, extra_locust_args=[
                                    "--prompt-file", PROMPTS, "--num-prompts", "64", "--temperature", "1.0",
                                    "--feedback-share", "1", "--feedback-delay", "0.3"])
        prefix = tmp_path / "locust"
        code = run_locust(locust_command(srv.url, prefix, config.plan(), config), 90, tmp_path / "locust.log")
        assert code == 0, (tmp_path / "locust.log").read_text()[-3000:]
        rows = srv.app.state.service.records.snapshot()
    with open(f"{prefix}_stats.csv", newline="") as handle:
        stats = {row["Name"]: row for row in csv.DictReader(handle)}
    assert int(stats["/v1/feedback"]["Request Count"]) > 0 and int(stats["/v1/feedback"]["Failure Count"]) == 0

    requests = [r for r in rows if r["kind"] == "request"]
    feedback = [r for r in rows if r["kind"] == "reward"]
    assert requests and not any(r["reward_expected"] or r["reward"] is not None for r in requests)  # no answers sent
    assert len(feedback) >= 0.5 * len(requests)  # share 1; the last ones may still be waiting when the users stop
    assert {(r["reward_source"], r["feedback_source"]) for r in feedback} == {("feedback", "loadtest")}
    answers = {p.messages[-1]["content"]: p.ground_truth for p in load_prompts(PROMPTS, "prompt", 64)}
    rule = get_reward_fn("arithmetic")
    verdicts = []
    for row in join_rewards(rows, "feedback"):
        if row["reward"] is None:
            continue
        value = rule("loadtest", row["answer"], str(answers[row["prompt"][-1]["content"]]))
        expected = float(value["score"] if isinstance(value, dict) else value)
        verdicts.append((row["reward"], 1.0 if expected >= 0.5 else 0.0))
    assert verdicts and all(given == expected for given, expected in verdicts)
    assert {given for given, _ in verdicts} == {0.0, 1.0}, verdicts  # right and wrong answers both judged
