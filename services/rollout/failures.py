"""What the rollout worker tells about episodes that went wrong, so none goes unseen:

- every failed attempt is counted by exception type (`failed_by_<Type>` on METRICS, read by `jetrl up`'s
  live line and summary and by `jetrl status`),
- a failure is logged with the workflow's name and its traceback, the first of each kind at once and
  then at most once per `log_every_s` per kind (with how many were not logged in between),
- a group that shrank because some of its episodes returned None is counted and warned about (as
  AReaL warns), with the workflow's name,
- `fail_fast_after` failed attempts while no episode of the worker has succeeded yet make the worker
  stop with the last one's exception (`EpisodesFailing`): a workflow that fails every episode would
  otherwise burn the whole dataset in silence. Once one episode succeeded, failures are counted and
  logged but never stop the worker (an outage of a server mid-run is waited out, as before).
"""

from __future__ import annotations

import contextvars
import time
from collections import Counter
from dataclasses import dataclass, field

from services.common.logging import get_logger

log = get_logger("rollout")


class EpisodesFailing(RuntimeError):
    """Every episode so far failed: the worker stops rather than burn prompts (`fail_fast_after`)."""


@dataclass
class EpisodeFailures:
    workflow: str
    """The workflow's name, as the user wrote it (in every log line)."""
    fail_fast_after: int = 0
    """Failed attempts, with no success yet, after which the worker stops; 0: never."""
    log_every_s: float = 30.0
    """A kind (workflow, exception type) is logged with its traceback at most this often."""
    by_type: Counter[str] = field(default_factory=Counter)
    shrunk: int = 0
    """Groups that lost episodes which returned None (the rest trained)."""
    not_accepted: int = 0
    """Groups `should_accept_fn` refused."""
    successes: int = 0
    last: BaseException | None = None
    _logged_at: dict[str, float] = field(default_factory=dict)
    _unlogged: Counter[str] = field(default_factory=Counter)

    def failed(self, exc: BaseException, *, prompt_id: str, attempt: int, final: bool) -> None:
        """One failed attempt of an episode (`final`: no retry follows, the prompt is rejected)."""
        kind = type(exc).__name__
        self.by_type[kind] += 1
        self.last = exc
        now = time.monotonic()
        what = "episode failed; prompt rejected" if final else "episode failed; retrying later"
        if now - self._logged_at.get(kind, -float("inf")) >= self.log_every_s:
            self._logged_at[kind] = now
            skipped = self._unlogged.pop(kind, 0)
            log.error(what, workflow=self.workflow, prompt_id=prompt_id, attempt=attempt, error=f"{kind}: {exc}",
                      same_kind_unlogged=skipped, exc_info=exc)
        else:  # logged recently: counted, and the next log line says how many
            self._unlogged[kind] += 1

    def succeeded(self) -> None:
        self.successes += 1

    def fatal(self) -> EpisodesFailing | None:
        """The error to stop the worker with: `fail_fast_after` attempts failed and none succeeded."""
        failed = sum(self.by_type.values())
        if not self.fail_fast_after or self.successes or failed < self.fail_fast_after or self.last is None:
            return None
        exc = self.last
        error = EpisodesFailing(
            f"workflow {self.workflow}: {failed} episode attempts failed and none succeeded (fail_fast_after="
            f"{self.fail_fast_after}); failures by type: {dict(self.by_type)}; the last: {type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error

    def group_shrunk(self, kept: int, size: int) -> None:
        self.shrunk += 1
        log.warning("episodes returned None; the group trains with fewer samples", workflow=self.workflow,
                    kept=kept, group_size=size, groups_shrunk=self.shrunk)

    def counters(self) -> dict[str, float]:
        """The METRICS values: totals since the worker started."""
        values = {f"failed_by_{kind}": float(n) for kind, n in self.by_type.items()}
        values["episodes_failed_total"] = float(sum(self.by_type.values()))
        values["groups_shrunk_total"] = float(self.shrunk)
        values["groups_not_accepted_total"] = float(self.not_accepted)
        return values


# The running episode's failure book, so `GroupedRolloutWorkflow` (which knows no worker) can report
# a shrunk group to the worker that runs it.
_CURRENT: contextvars.ContextVar[EpisodeFailures | None] = contextvars.ContextVar("jetrl_episode_failures", default=None)


def set_current(failures: EpisodeFailures) -> contextvars.Token[EpisodeFailures | None]:
    return _CURRENT.set(failures)


def note_shrunk(kept: int, size: int) -> None:
    """A group kept `kept` of its `size` episodes (the others returned None)."""
    book = _CURRENT.get()
    if book is not None:
        book.group_shrunk(kept, size)
    else:
        log.warning("episodes returned None; the group trains with fewer samples", kept=kept, group_size=size)


def note_not_accepted() -> None:
    """`should_accept_fn` refused a group (logged at debug: it is a choice, counted on METRICS)."""
    book = _CURRENT.get()
    if book is not None:
        book.not_accepted += 1
        log.debug("group not accepted by should_accept_fn", workflow=book.workflow, groups_not_accepted=book.not_accepted)
