"""What the trainer does with each trajectory message: decode and check it (`validate.py`), then accept
it into the next step, or count it as rejected (marker, stale) so the feeder re-issues, or as filtered
(zero-variance: freed, not re-issued), or skip a duplicate or a foreign one (a prompt of an earlier
incarnation of the run), or terminate a malformed one (does not decode, or fails a check: counted by
cause). Pure bookkeeping: the bus loop lives in `consumer.py`.

A live trainer (`check_tags`) trains only answers to prompts it issued in this run or that a
configured issuer tagged: each prompt carries an HMAC over (run, prompt id) under the run's key (kept
in checkpoints, so answers to prompts issued before a restart still check out) or an issuer's key,
and a rollout worker copies it onto its answer. A group or rejection marker without a valid tag is
terminated as `unissued_prompt` and never touches the feeder (it must not cost a real prompt a try).

The versions a group is judged against are the trainer's version window (`versions.py`: eta,
`first_version`, `own_from`), which the intake reads and never writes. A trainer that continued the
numbering of a run name used before (`feed/fresh.py`: `first_version` N+1) never trains a group
generated with older weights: they are the earlier run's. Such a group is judged `stale` (its row is
re-issued, uncharged), counted as `stale_earlier_run`. A trainer resumed behind the version it
announced before it was killed (`own_from`, past `first_version`: see `loop.py` `_catch_up`) does the
same with groups generated with weights older than its restored ones' new number.

An accepted group is `pending` until its step is applied (`commit`): only then is its prompt id
`trained`. The checkpointed state is the state at the last commit, so a stop between judging and
training leaves the group to be read and trained again after a resume."""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from schemas.headers import is_rejection, prompt_tag_of
from schemas.messages import MessageError, RejectionMarker, decode
from schemas.metric_names import GroupOutcome
from schemas.subjects import HDR_PROMPT_ID
from schemas.trajectory import DecodedGroup, TrajectoryError, decode_group
from services.common.logging import get_logger
from services.common.settings import SettingsError
from services.common.signing import prompt_tag, prompt_tag_ok
from services.trainer.intake.validate import Limits, check_group
from services.trainer.versions import VersionWindow

if TYPE_CHECKING:
    from services.trainer.settings import TrainerSettings

log = get_logger("trainer")


@dataclass
class Group:
    prompt_id: str
    tensors: dict[str, np.ndarray]
    head_version: int
    seq: int


@dataclass
class Verdict:
    outcome: GroupOutcome
    """accepted | rejected | stale | filtered | duplicate | foreign | malformed (terminated, see `cause`)"""
    prompt_id: str | None = None
    group: Group | None = None
    error: str = ""
    cause: str = ""
    """Why a malformed message is terminated: one of `validate.CAUSES`; for a stale group, `earlier_run`
    when its weights are an earlier run's, or versions a killed trainer announced past its checkpoint
    (empty: merely more than eta versions old)."""
    worker: str = ""
    """The rollout worker that sent the group, when its metadata could be read."""


class PromptIssuer(Protocol):
    """Who issued the prompts the intake judges answers to (the feeder, `feed/feeder.py`): which prompt
    ids are its, and what each answer means for its prompt (tried again, charged, or done)."""

    def owns(self, prompt_id: str) -> bool: ...
    def on_accepted(self, prompt_id: str) -> bool: ...
    def on_rejected(self, prompt_id: str, cause: str = "rejected") -> bool: ...
    def on_stale(self, prompt_id: str) -> bool: ...
    def on_filtered(self, prompt_id: str) -> bool: ...


@dataclass
class Intake:
    window: VersionWindow
    """The trainer's version window (`versions.py`): eta, `first_version`, `own_from`; read only."""
    dynamic_filtering: bool = False
    feeder: PromptIssuer | None = None
    own_versions: bool = True
    """Versions on the groups are this trainer's (a live run): one newer than the trainer is an error.
    False for a replay, where they are the recorded run's."""
    limits: Limits = field(default_factory=lambda: Limits(None, None))
    """Token ids and row lengths a group must stay within."""
    trained: set[str] = field(default_factory=set)
    """Every prompt_id whose group was trained (checkpointed): a redelivered or replayed one is skipped."""
    pending: set[str] = field(default_factory=set)
    """Accepted, not yet trained (not checkpointed): a copy arriving meanwhile is a duplicate too."""
    counts: Counter[str] = field(default_factory=Counter)
    """Verdicts since the run started, plus `terminated_<cause>` for each terminated message."""
    committed: Counter[str] = field(default_factory=Counter)
    """`counts` at the last commit: what a checkpoint saves (what a resume reads again is counted again)."""
    run: str = ""
    """The run whose prompts are tagged and checked."""
    check_tags: bool = False
    """Train only answers carrying a valid prompt tag (a live trainer); False: unit tests, replay."""
    run_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """This run's prompt key: tags the feeder's prompts; saved in checkpoints, restored on resume."""
    issuer_keys: tuple[bytes, ...] = ()
    """Keys of other prompt issuers (`trust.prompt_issuer_key`, for `jetrl prompts push`)."""

    def is_trained(self, prompt_id: str) -> bool:
        """Whether the group of `prompt_id` was trained (the feeder skips a re-issue of it)."""
        return prompt_id in self.trained

    def tag_for(self, prompt_id: str) -> str:
        """The tag the feeder puts on a prompt it issues."""
        return prompt_tag(self.run_key, self.run, prompt_id)

    def _issued(self, prompt_id: str, headers: dict[str, str] | None) -> bool:
        if not (self.check_tags and self.own_versions):
            return True
        return prompt_tag_ok((self.run_key, *self.issuer_keys), prompt_tag_of(headers), self.run, prompt_id)

    def judge(self, data: bytes, headers: dict[str, str] | None, seq: int, version: int, *,
              decoded: DecodedGroup | Exception | None = None) -> Verdict:
        """`decoded`: `decode_group(data)` already done by the caller (replay decodes a pull's groups
        together), or the exception it raised; None: decoded here."""
        verdict = self._judge(data, headers, seq, version, decoded)
        self.counts[verdict.outcome] += 1
        if verdict.outcome == "malformed":
            self.counts[f"terminated_{verdict.cause}"] += 1
        elif verdict.outcome == "stale" and verdict.cause:
            self.counts[f"stale_{verdict.cause}"] += 1
            log.warning("group generated with an earlier run's weights; not trained, its prompt re-issued",
                        prompt_id=verdict.prompt_id, worker=verdict.worker, first_version=self.window.first_version,
                        cause=verdict.cause)
        pid = verdict.prompt_id
        if verdict.cause == UNISSUED:
            pass  # not an answer to a prompt of ours: the feeder's real prompt keeps its tries
        elif verdict.outcome == "accepted" and pid is not None:
            self.pending.add(pid)
            if self.feeder is not None:
                self.feeder.on_accepted(pid)
        elif verdict.outcome == "filtered" and pid is not None and self.feeder is not None:
            self.feeder.on_filtered(pid)
        elif verdict.outcome in ("rejected", "stale", "malformed") and pid is not None:
            # Each of these yields nothing trainable for the prompt: the feeder issues it again
            # (a stale group uncharged: old weights are not the row's fault).
            if self.feeder is not None:
                if verdict.outcome == "stale":
                    self.feeder.on_stale(pid)
                else:
                    self.feeder.on_rejected(pid, verdict.cause or verdict.outcome)
        return verdict

    def _judge(self, data: bytes, headers: dict[str, str] | None, seq: int, version: int,
               decoded: DecodedGroup | Exception | None) -> Verdict:
        header_pid = (headers or {}).get(HDR_PROMPT_ID)
        if is_rejection(headers):
            try:
                marker = decode(RejectionMarker, data)
            except MessageError as exc:
                return Verdict("malformed", header_pid, error=str(exc), cause="malformed")
            if not self._issued(marker.prompt_id, headers):
                return _unissued(marker.prompt_id, headers, marker.worker)
            if not self._ours(marker.prompt_id):
                return Verdict("foreign", marker.prompt_id)
            if self._seen(marker.prompt_id):
                return Verdict("duplicate", marker.prompt_id)
            return Verdict("rejected", marker.prompt_id)
        try:
            if isinstance(decoded, Exception):
                raise decoded
            group = decode_group(data, max_seq_len=self.limits.max_seq_len) if decoded is None else decoded
        except TrajectoryError as exc:
            meta = exc.meta
            return Verdict("malformed", meta.prompt_id if meta else header_pid, error=str(exc), cause=exc.cause,
                           worker=meta.worker if meta else "")
        except (ValueError, KeyError) as exc:
            return Verdict("malformed", header_pid, error=str(exc), cause="malformed")
        pid = group.meta.prompt_id
        if not self._ours(pid):
            return Verdict("foreign", pid)
        if self._seen(pid):
            return Verdict("duplicate", pid)
        problem = check_group(group.tensors, self.limits)
        if problem is not None:
            return Verdict("malformed", pid, error=problem.error, cause=problem.cause, worker=group.meta.worker)
        if not self._issued(pid, headers):
            return _unissued(pid, headers, group.meta.worker)
        head, tail = group.meta.head_version, group.meta.tail_version
        if head < 0 or (self.own_versions and tail > version):
            # weights the trainer never made (or none at all on trained tokens): the workflow or a
            # server is wrong, not the group late; never judged stale
            name = group.meta.workflow or "(unnamed workflow)"
            return Verdict("malformed", pid, error=f"workflow {name}: trained tokens carry weight versions {head}..{tail}, "
                           f"but the trainer is at version {version}", cause="impossible_versions", worker=group.meta.worker)
        if self.own_versions and head < self.window.oldest_own:
            return Verdict("stale", pid, cause=EARLIER_RUN, worker=group.meta.worker)
        if version - head > self.window.eta:
            return Verdict("stale", pid)
        rewards = group.tensors["rewards"]
        if self.dynamic_filtering and rewards.size > 0 and np.all(rewards == rewards.flat[0]):
            return Verdict("filtered", pid)
        return Verdict("accepted", pid, Group(pid, group.tensors, head, seq))

    def _ours(self, prompt_id: str) -> bool:
        return self.feeder is None or self.feeder.owns(prompt_id)

    def _seen(self, prompt_id: str) -> bool:
        return prompt_id in self.trained or prompt_id in self.pending

    def commit(self, prompt_ids: list[str]) -> None:
        """The step holding these groups was applied: they are trained, and everything judged so far
        is what a checkpoint saves."""
        self.trained.update(prompt_ids)
        self.pending.difference_update(prompt_ids)
        self.committed = Counter(self.counts)

    def state_dict(self) -> dict[str, Any]:
        """The trained prompt ids, the verdicts at the last commit, the prompt key (the version window's
        fields are the trainer's to save beside them: `loop.py`)."""
        state: dict[str, Any] = {"trained": sorted(self.trained), "counts": dict(self.committed)}
        if self.check_tags:
            state["prompt_key"] = self.run_key.hex()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("prompt_key"):  # a checkpoint from before prompt tags keeps this process's key
            self.run_key = bytes.fromhex(state["prompt_key"])
        self.trained = set(state["trained"])
        self.pending = set()
        self.counts = Counter(state["counts"])
        self.committed = Counter(self.counts)


UNISSUED = "unissued_prompt"
EARLIER_RUN = "earlier_run"
"""The cause of a stale group generated with weights of an earlier run of the same name."""


def _unissued(prompt_id: str, headers: dict[str, str] | None, worker: str) -> Verdict:
    why = "carries a tag no key of this trainer made" if prompt_tag_of(headers) else "carries no prompt tag"
    return Verdict("malformed", prompt_id, error=f"prompt {prompt_id}: not a prompt this run issued (the answer {why})",
                   cause=UNISSUED, worker=worker)


def trust_prompts(intake: Intake, settings: TrainerSettings, *, live: bool) -> None:
    """Set up the prompt-tag check of a trainer: a live one checks tags (its feeder's under the run
    key, `jetrl prompts push`'s under `trust.prompt_issuer_key`); a replay trains a recording and
    does not. A live trainer without a feeder and without an issuer key could trust nothing: refused."""
    intake.run = settings.run
    intake.check_tags = live
    issuer = settings.trust.prompt_issuer()
    intake.issuer_keys = (issuer,) if issuer else ()
    if live and not settings.feeder.enabled and not issuer:
        raise SettingsError("feeder.enabled is false and trust.prompt_issuer_key is unset: the trainer could not tell "
                            "a pushed prompt's group from a forged one; give it and `jetrl prompts push` the same "
                            "trust.prompt_issuer_key (or _file)")
