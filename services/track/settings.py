"""Settings of `jetrl track`: one section per sink; a sink is on when its section says so."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from services.common.settings import Section, ServiceSettings


class TensorBoardSection(Section):
    log_dir: str = ""
    """Directory for TensorBoard event files (`tensorboard --logdir DIR`); empty = TensorBoard off."""
    flush_s: float = Field(5.0, gt=0)
    """Flush the event file at least this often."""


class WandbSection(Section):
    mode: Literal["disabled", "offline", "online"] = "disabled"
    """disabled | offline (writes a local run, needs no network; `wandb sync DIR` uploads it later) |
    online (needs WANDB_API_KEY and network)."""
    project: str = "jetrl"
    """W&B project."""
    entity: str = ""
    """W&B entity (team or user); empty = your default."""
    dir: str = ""
    """Where W&B writes its local files (the `wandb/` folder); empty = the current directory."""
    name: str = ""
    """W&B run name; empty = the jetrl run name."""


class TrackSettings(ServiceSettings):
    service: ClassVar[str] = "track"

    tensorboard: TensorBoardSection = TensorBoardSection()
    """TensorBoard sink."""
    wandb: WandbSection = WandbSection()
    """Weights & Biases sink."""
    config_path: str = ""
    """A YAML or JSON file with the run's configuration, logged once as the trackers' run config
    (`jetrl up` passes the settings of every service)."""
    from_start: bool = True
    """Read the METRICS stream from its first event of this run (a tracker started late, or again,
    writes the whole run); false = only events from now on."""
    run_dir: str = "runs"
    """Where `jetrl up` keeps runs: unless `nats_url` is given, a live run's own server
    (<run_dir>/<run>/nats.url) is followed, as the run's `track` user unless `nats_auth` is given."""
    max_failures: int = Field(20, ge=1)
    """A sink that fails this many times in a row is switched off (logged; the others go on)."""
