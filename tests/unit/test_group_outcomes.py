"""The intake's verdicts are a closed set of names declared in `schemas/`: what the trainer emits as
`total_<outcome>` / `<outcome>_groups` is what `jetrl status` reads, and on the wire they stay plain
strings in the METRICS event."""

from __future__ import annotations

import typing

import msgpack

from schemas.headers import rejection_headers
from schemas.messages import MetricsEvent, RejectionMarker, decode, encode
from schemas.metric_names import GROUP_OUTCOMES, GroupOutcome
from services.status.groups import OUTCOMES
from services.trainer.feed.ledger import PromptLedger
from services.trainer.intake.intake import Intake, Verdict
from services.trainer.versions import VersionWindow


def test_verdict_outcome_is_the_declared_type() -> None:
    assert typing.get_type_hints(Verdict)["outcome"] == GroupOutcome
    assert set(GROUP_OUTCOMES) == {"accepted", "stale", "rejected", "filtered", "duplicate", "foreign", "malformed"}
    assert OUTCOMES == GROUP_OUTCOMES  # what `jetrl status` reads


def test_the_verdicts_an_intake_gives_are_declared_names() -> None:
    ledger = PromptLedger(run="r", rows=[{"prompt": "p", "answer": "a"}], batch_groups=1, window=VersionWindow(0), max_in_flight=1,
                          tag="ours")
    intake = Intake(ledger.window, feeder=ledger)  # type: ignore[arg-type]  # the ledger answers what the intake asks
    task = ledger.next_task(0)
    assert task is not None

    def marker(prompt_id: str) -> Verdict:
        body = encode(RejectionMarker(run="r", prompt_id=prompt_id, worker="w", reason="x"))
        return intake.judge(body, rejection_headers("r", prompt_id), seq=1, version=0)

    seen = [marker("0-0.theirs").outcome, marker(task.prompt_id).outcome,
            intake.judge(b"not arrow", {}, seq=2, version=0).outcome]
    assert seen == ["foreign", "rejected", "malformed"]
    assert set(intake.counts) <= set(GROUP_OUTCOMES) | {"terminated_malformed"}


def test_outcome_names_travel_as_plain_strings() -> None:
    values = {f"total_{o}": float(i) for i, o in enumerate(GROUP_OUTCOMES)}
    event = MetricsEvent(run="r", service="trainer", step=3, values=values)
    body = encode(event)
    assert msgpack.unpackb(body, raw=False)["values"] == values  # the bytes carry the names as they are
    assert decode(MetricsEvent, body).values == values
