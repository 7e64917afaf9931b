"""`jetrl weights`: the agent beside one inference server.

At start it waits for the server, reads the version the server holds, and reads the weight-sync
subject from its last message on, so a late joiner loads the latest published version at once.
For each announcement: fetch and verify, `/pause_generation` (abort), `/update_weights_from_disk`,
`/continue_generation`, then `WeightsLoaded`. An announcement that arrives while an older one is still
being fetched cancels that fetch (the newer wins; the server is not paused for a version that is
already stale). Any failure is reported as `WeightsLoadFailed`; the server keeps its old weights and
generation is always resumed; the next announcement is tried afresh. A report that NATS does not
acknowledge (a server restarting) is retried with capped backoff for `report_retry_s`, then logged and
counted: a lost report never stops the agent.

The latest announcement is loaded whatever its number, also one below the version served (a trainer
resumed from an older checkpoint, which announces under a newer epoch): logged, counted
(`version_decreases`), and the cached copies of the higher versions are dropped with it. One older
than the newest accepted by (epoch, version) - a recorded announcement replayed - is refused.

An announcement is acted on only if it is signed by the trainer (when `trust.announce_key` is set)
and names weights under `weight_roots` (`services/weights/trust.py`); any other is refused before a
file is read or the server paused: logged, counted (`announcements_refused`, `refused_<cause>`) and
reported as `WeightsLoadFailed` naming only the cause.

A NATS outage never stops it either: a download is resumed through it (`bus_retry_timeout_s`), and as
soon as the client is back the last announcement is re-read from the stream, so a version announced
while the agent's subscription was down is loaded at once, not at the next publish.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from schemas.messages import Message, WeightsLoaded, WeightsLoadFailed, WeightsPublished, encode
from schemas.subjects import WEIGHTS_BUCKET, Subjects
from services.common.bus import Bus, close_connection
from services.common.busretry import BusUnavailable, RetryPolicy, retry, with_retries
from services.common.health import http_check, register_check
from services.common.logging import bind_context, get_logger
from services.common.metrics import MetricsPublisher
from services.common.runner import Supervisor, supervise
from services.weights.agent.fetch import FetchError, Retry, fetch_version
from services.weights.agent.listen import AnnouncementFeed
from services.weights.agent.server_client import READY_POLL_TIMEOUT_S, ServerClient, ServerError, readiness_urls
from services.weights.announcements import ensure_weight_sync_stream
from services.weights.files import remove_tree, version_dirs, versions_to_drop
from services.weights.settings import WeightsSettings
from services.weights.trust import Freshness, Refused, check, default_roots

log = get_logger("weights.agent")

RESUME_ATTEMPTS = 5
REPORT_TIMEOUT_S = 5.0
"""Longest wait for the stream's ack of one report publish."""


class WeightsAgent:
    def __init__(self, nc: NATS, server: ServerClient, settings: WeightsSettings, metrics: MetricsPublisher,
                 retry: RetryPolicy | None = None) -> None:
        """`retry`: the service's retry policy (`Bus.retry`; None: a fresh one)."""
        self.nc = nc
        self.retry = retry if retry is not None else RetryPolicy()
        self.js = nc.jetstream()
        self.server = server
        self.settings = settings
        self.metrics = metrics
        self.subjects = Subjects(settings.run)
        self.cache_dir = Path(settings.cache_dir).resolve()
        self.loaded_version: int | None = None
        self._wanted: WeightsPublished | None = None
        self._received = 0  # announcements received; the loader handles each at most once
        self._handled = 0
        self._wake = asyncio.Event()
        self._fetching: tuple[int, asyncio.Task[Path]] | None = None
        self.announce_key = settings.trust.announce()
        self.roots = settings.weight_roots or default_roots(settings.run, WEIGHTS_BUCKET)
        self._refusals: set[asyncio.Future[bool]] = set()
        self.freshness = Freshness(settings.run)

    # ------------------------------------------------------------------------------ announcements

    async def listen(self, stopping: asyncio.Event) -> None:
        """Follow the weight-sync subject from its last message on (late joiners catch up at once), and
        re-read its last message as soon as NATS is back after an outage (`listen.AnnouncementFeed`)."""
        feed = AnnouncementFeed(self.nc, self.subjects.weights_published, self.offer, self.metrics,
                                self.settings.bus_retry_timeout_s, missing=self.missing, policy=self.retry)
        await feed.run(stopping)

    def missing(self, announced: WeightsPublished) -> bool:
        """Whether `announced` is neither served nor being handled (e.g. its fetch gave up during an
        outage): re-read after a reconnect, it is then offered again."""
        idle = self._handled == self._received and self._fetching is None
        return idle and announced.version != self.loaded_version

    def offer(self, announced: WeightsPublished) -> None:
        """The latest announcement is the one to load; an older one still being fetched is dropped.
        One the trainer did not sign, or naming weights outside the roots, is refused here."""
        try:
            check(announced, self.announce_key, self.roots)
            self.freshness.check(announced)
        except Refused as exc:
            self._refuse(announced, exc)
            return
        self.freshness.accept(announced)
        log.info("weights announced", version=announced.version, step=announced.step, uri=announced.uri)
        self._wanted = announced
        self._received += 1
        if self._fetching is not None and self._fetching[0] != announced.version:
            old, task = self._fetching
            log.info("newer version supersedes the one being fetched", fetching=old, newer=announced.version)
            self.metrics.count("superseded")
            task.cancel()
        self._wake.set()

    def _refuse(self, announced: WeightsPublished, exc: Refused) -> None:
        log.error("weights announcement refused", cause=exc.cause, version=announced.version, uri=announced.uri,
                  serving=self.loaded_version)
        self.metrics.count("announcements_refused")
        self.metrics.count(f"refused_{exc.cause}")
        report = WeightsLoadFailed(run=self.settings.run, server=self.settings.server_name, version=announced.version,
                                   reason=str(exc))
        task = asyncio.ensure_future(self._report_refusal(report))
        self._refusals.add(task)  # held until done: a report task nothing references may be collected
        task.add_done_callback(self._refusals.discard)

    async def _report_refusal(self, report: WeightsLoadFailed) -> bool:
        ok = await self.report(self.subjects.weights_failed(self.settings.server_name), report)
        await self.metrics.emit({}, version=self.loaded_version)
        return ok

    # ------------------------------------------------------------------------------------ loading

    async def load_loop(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            if self._handled == self._received:
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                stopper = asyncio.ensure_future(stopping.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                continue
            self._handled = self._received
            target = self._wanted
            assert target is not None
            if target.transport in ("broadcast", "colocated"):
                caught_up = await self.catch_up_target(target)
                if caught_up is None:
                    continue
                target = caught_up
            if target.version == self.loaded_version:
                log.info("server already holds the announced version", version=target.version)
                continue
            if self.loaded_version is not None and target.version < self.loaded_version:
                # A newer epoch's lower version (offer refused an older epoch's): a trainer resumed from
                # an older checkpoint publishes below what the servers serve, and refusing it would
                # leave them on weights that trainer never made (its groups all impossible) for good.
                log.warning("announced version is older than the one served; loading it (a newer trainer epoch)",
                            version=target.version, serving=self.loaded_version, epoch=target.epoch)
                self.metrics.count("version_decreases")
            await self.load(target)

    async def catch_up_target(self, announced: WeightsPublished) -> WeightsPublished | None:
        """A version the trainer broadcast: a member already holds it; a server outside the group
        catches up from the latest disk copy (if newer than what it serves) and joins the broadcast
        at a later version. Returns the disk version to load, or None."""
        if self.settings.server in announced.members:
            self.loaded_version = announced.version
            log.info("server received the version by broadcast", version=announced.version)
            return None
        if announced.disk_version is None or not announced.uri:
            log.info("version broadcast without this server and no disk copy yet; waiting for the next broadcast",
                     version=announced.version)
            return None
        try:
            serving = await self.server.get_weight_version()
        except ServerError as exc:
            log.warning("cannot read the server's version; not catching up now", error=str(exc))
            return None
        if serving >= announced.disk_version:
            self.loaded_version = serving
            return None
        log.info("catching up from the latest disk copy", version=announced.disk_version, broadcast=announced.version, serving=serving)
        self.metrics.count("catch_ups")
        return announced.model_copy(update={"version": announced.disk_version, "transport": "disk", "members": []})

    async def load(self, target: WeightsPublished) -> bool:
        """Fetch, verify and load one version. True if the server now serves it."""
        t0 = time.perf_counter()
        bind_context(version=target.version)
        patience = Retry(self.settings.chunk_timeout_s, self.settings.bus_retry_timeout_s,
                         on_retry=lambda _: self.metrics.count("fetch_retries"), policy=self.retry)
        fetch = asyncio.ensure_future(fetch_version(self.js, target, self.cache_dir, patience))
        self._fetching = (target.version, fetch)
        try:
            path: Path | None = await fetch
            failure = ""
        except asyncio.CancelledError:
            if fetch.cancelled() and not _current_task_cancelling():
                return False  # superseded by a newer announcement; the loop moves on to it
            raise
        except FetchError as exc:
            path, failure = None, str(exc)
        finally:
            # no longer fetching before the failure is reported: a reconnect meanwhile re-reads the
            # announcement, and `missing` must see this version as not being handled, or it is lost
            self._fetching = None
        if path is None:
            await self._failed(target.version, failure)
            return False
        fetch_s = time.perf_counter() - t0
        ok, reason, paused_s = await self._swap(path, target.version)
        if not ok:
            await self._failed(target.version, reason)
            return False
        seconds = time.perf_counter() - t0
        self.loaded_version = target.version
        report = WeightsLoaded(run=self.settings.run, server=self.settings.server_name, version=target.version, seconds=seconds)
        await self.report(self.subjects.weights_loaded(self.settings.server_name), report)
        log.info(
            "weights loaded",
            version=target.version,
            seconds=round(seconds, 3),
            fetch_s=round(fetch_s, 3),
            paused_s=round(paused_s, 3),
        )
        self.metrics.count("loads")
        await self.metrics.emit(
            {"weights_version": target.version, "load_seconds": seconds, "fetch_seconds": fetch_s, "paused_seconds": paused_s},
            version=target.version,
        )
        self._clean_cache()
        return True

    async def _swap(self, path: Path, version: int) -> tuple[bool, str, float]:
        """Pause, load, and resume whatever happened: (ok, reason if not, seconds paused)."""
        t0 = time.perf_counter()
        reason = ""
        try:
            await self.server.pause(self.settings.pause_mode)
            await self.server.update_weights_from_disk(str(path), version)
        except ServerError as exc:
            reason = str(exc)
        finally:
            # Shielded: generation must be resumed even if the agent is being cancelled meanwhile.
            resumed = await asyncio.shield(self._resume())
        if not resumed:
            reason = (reason + "; " if reason else "") + "continue_generation failed: server may be left paused"
        return not reason, reason, time.perf_counter() - t0

    async def _resume(self) -> bool:
        """`continue_generation`, tried RESUME_ATTEMPTS times (each failure logged); False if none succeeded."""

        def failed(exc: BaseException, attempt: int) -> None:
            log.error("continue_generation failed", attempt=attempt, error=str(exc))

        try:
            await retry(self.server.resume, when=lambda exc: isinstance(exc, ServerError), attempts=RESUME_ATTEMPTS,
                        initial_s=0.2, max_s=2.0, on_retry=failed)
            return True
        except ServerError as exc:
            failed(exc, RESUME_ATTEMPTS)
            return False

    async def _failed(self, version: int, reason: str) -> None:
        log.error("weights load failed; server keeps its current version", version=version, serving=self.loaded_version, reason=reason)
        self.metrics.count("load_failures")
        report = WeightsLoadFailed(run=self.settings.run, server=self.settings.server_name, version=version, reason=reason)
        await self.report(self.subjects.weights_failed(self.settings.server_name), report)
        await self.metrics.emit({}, version=self.loaded_version)

    async def report(self, subject: str, message: Message) -> bool:
        """Publish a WeightsLoaded/WeightsLoadFailed report and wait for the stream's ack, retrying
        what a NATS restart looks like (`services.common.busretry`) for `report_retry_s`. False if it
        was given up: logged and counted (`report_failures`), never raised - the server serves what it
        serves either way."""
        data = encode(message)
        timeout = min(REPORT_TIMEOUT_S, max(0.5, self.settings.report_retry_s))  # one attempt never outlasts the budget

        async def publish() -> None:
            # bounded twice: nats-py may never resolve a publish the server answered oddly
            await asyncio.wait_for(self.js.publish(subject, data, timeout=timeout), timeout + 1.0)

        try:
            await with_retries(f"weights report {subject}", publish, self.settings.report_retry_s,
                               on_retry=lambda _: self.metrics.count("report_retries"), policy=self.retry)
            return True
        except (BusUnavailable, nats.errors.Error) as exc:  # gone too long, or refused: no retry helps
            log.error("weights report lost", subject=subject, error=repr(exc))
            self.metrics.count("report_failures")
            return False

    def _clean_cache(self) -> None:
        """Drop local copies of old versions and partial fetches left by a crash."""
        dirs = version_dirs(self.cache_dir)
        protect = {self.loaded_version} if self.loaded_version is not None else set()
        drop = set(versions_to_drop(set(dirs), self.settings.keep_local, protect=protect))
        if self.loaded_version is not None:  # newer than what is served: left from before the version went down
            drop |= {v for v in dirs if v > self.loaded_version}
        for v in sorted(drop):
            remove_tree(dirs[v])
        if self.cache_dir.is_dir() and self._fetching is None:
            for p in self.cache_dir.glob(".v*.partial"):
                remove_tree(p)



def _current_task_cancelling() -> bool:
    task = asyncio.current_task()
    return bool(task is not None and task.cancelling())


async def run_agent(settings: WeightsSettings, bus: Bus) -> None:
    await supervise("weights", lambda sup: _start(sup, settings, bus), settings.shutdown_timeout_s, retry=bus.retry)


async def _start(sup: Supervisor, settings: WeightsSettings, bus: Bus) -> None:
    bind_context(server=settings.server_name)
    nc = await bus.connect(f"jetrl-weights-{settings.server_name}")
    sup.stack.push_async_callback(close_connection, nc)
    await ensure_weight_sync_stream(nc, settings.bus_retry_timeout_s, bus=bus)
    server = ServerClient(settings.server, settings.request_timeout_s, settings.pause_mode, settings.trust.inference_keys())
    sup.stack.push_async_callback(server.aclose)
    register_check("inference reachable", http_check(*readiness_urls(settings.server), timeout_s=READY_POLL_TIMEOUT_S))
    if not await server.wait_ready(settings.server_ready_timeout_s, sup.stopping):
        return
    agent = WeightsAgent(nc, server, settings, MetricsPublisher(nc, settings.run, "weights", worker=settings.server_name),
                         bus.retry)
    agent.loaded_version = await server.get_weight_version()
    agent._clean_cache()
    log.info("agent ready", server=settings.server, serving=agent.loaded_version)
    sup.spawn("announcements", agent.listen(sup.stopping))
    sup.spawn("loader", agent.load_loop(sup.stopping))
