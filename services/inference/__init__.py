"""`jetrl inference`: an SGLang-protocol server on CPU with a transformers causal LM (or `simulate`)."""

from __future__ import annotations

from services.common.entry import service_main
from services.inference.settings import InferenceSettings


def main(argv: list[str] | None = None) -> int:
    return service_main(
        InferenceSettings,
        "services.inference.server:run",
        argv,
        "SGLang-protocol inference server on CPU: /generate with iteration-level batching, "
        "pause/continue, update_weights_from_disk. Ready when GET /health is 200.",
        uses_bus=False,  # the server speaks HTTP only
    )
