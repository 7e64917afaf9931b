"""The live view of `jetrl up`: a rich table on a terminal, one line per trainer step otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.up.monitor import ACCURACY_KEYS, REWARD_KEYS, STALENESS_KEYS, WAIT_KEYS, RunView, pick
from services.up.report import outcome_text
from services.up.settings import UpSettings
from services.up.stack import Stack


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class Display:
    def __init__(self, settings: UpSettings, view: RunView, stack: Stack) -> None:
        self.settings = settings
        self.view = view
        self.stack = stack
        mode = settings.display
        if mode == "auto":
            mode = "live" if sys.stdout.isatty() else "lines"
        self.mode = mode
        self._live: Live | None = None
        self._printed_step = -1
        self._printed_outcomes = ""
        self._printed_store = ""

    def __enter__(self) -> Display:
        if self.mode == "live":
            self._live = Live(self._table(), console=Console(), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None

    def refresh(self) -> None:
        store = self.view.store.line()
        if self.mode == "lines" and store != self._printed_store:  # said at once, whether or not a step comes
            print(store or "store writable again", flush=True)
            self._printed_store = store
        if self._live is not None:
            self._live.update(self._table())
        elif self.mode == "lines" and self.view.step != self._printed_step and self.view.steps:
            self._printed_step = self.view.step
            print(self._line(), flush=True)
        elif self.mode == "lines" and not self.view.steps:
            # before the first step: failing episodes are said at once, not after the first step
            failures = outcome_text(self.view.episode_outcomes())
            if failures and failures != self._printed_outcomes:
                self._printed_outcomes = failures
                print(f"no step yet; rollout: {failures}", flush=True)

    def _line(self) -> str:
        last = self.view.steps[-1]
        servers = " ".join(f"v{v}" for _, v in sorted(self.view.servers.items())) or "-"
        return (
            f"step {last['step']}/{self.settings.total_steps} version {last.get('version')} "
            f"reward {_fmt(pick(last, REWARD_KEYS))} (10-step {_fmt(self.view.recent(REWARD_KEYS))}) "
            f"acc {_fmt(pick(last, ACCURACY_KEYS))} stale {_fmt(pick(last, STALENESS_KEYS), '.2f')} "
            f"wait {_fmt(pick(last, WAIT_KEYS), '.2f')} rollout {self.view.rollout_rate():.1f} ep/s "
            f"servers {servers} t={last['time']:.0f}s"
            + (f" | eval@{self.view.evals[-1]['step']} {_fmt(self.view.evals[-1].get('eval_reward_mean'))}" if self.view.evals else "")
            + (f" | {failures}" if (failures := outcome_text(self.view.episode_outcomes())) else "")
            + (f" | {store}" if (store := self.view.store.line()) else "")
        )

    def _table(self) -> Table:
        v = self.view
        last = v.steps[-1] if v.steps else {}
        table = Table(title=f"jetrl up - run {self.settings.run}  ({time.time() - v.started:.0f} s)", show_header=False, min_width=60)
        table.add_column("what", style="bold")
        table.add_column("value")
        table.add_row("trainer step", f"{v.step} / {self.settings.total_steps}")
        table.add_row("weight version", str(last.get("version", 0)))
        table.add_row("reward mean (last / 10-step)", f"{_fmt(pick(last, REWARD_KEYS))} / {_fmt(v.recent(REWARD_KEYS))}")
        table.add_row("accuracy", _fmt(pick(last, ACCURACY_KEYS)))
        if v.evals:
            ev = v.evals[-1]
            table.add_row(
                f"eval reward / accuracy (step {ev['step']})",
                f"{_fmt(ev.get('eval_reward_mean'))} / {_fmt(ev.get('eval_accuracy'))}",
            )
        table.add_row("staleness (versions)", _fmt(pick(last, STALENESS_KEYS), ".2f"))
        table.add_row("trainer wait fraction", _fmt(pick(last, WAIT_KEYS), ".2f"))
        table.add_row("rollout episodes/s", f"{v.rollout_rate():.1f} ({v.live_workers('rollout')} workers reporting)")
        table.add_row("rollout failures", outcome_text(v.episode_outcomes()) or "none")
        if v.store.full:
            table.add_row("[red]store[/red]", f"[red]{v.store.line()}[/red]: the run waits until space returns")
        for server, version in sorted(v.servers.items()):
            table.add_row(f"server {server}", f"weights v{version}")
        alive = sum(1 for p in self.stack.procs if p.poll() is None)
        table.add_row("processes", f"{alive}/{len(self.stack.procs)} alive; logs in {self.stack.logs}")
        return table
