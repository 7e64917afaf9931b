"""`engine: sglang`: serve with real SGLang (`python -m sglang.launch_server`) instead of the CPU server.

The same settings (model, host, port, weight version, batch size, context length) become SGLang's flags,
plus the ones jetrl's clients rely on (see docs/sglang.md): `--enable-metrics`, and
`--skip-tokenizer-init` (token ids in and out; the rollout engine applies stop strings itself) when
`skip_tokenizer_init` is set, as `jetrl up` sets it unless the workflow is an agent (SGLang then has no
grammar backend, so constrained requests need the tokenizer). `jetrl up` and the
containers start `jetrl inference` as before; with `engine: sglang` it runs SGLang as its child, in its
process group, and ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys

from services.common.logging import get_logger
from services.inference.settings import InferenceSettings

log = get_logger("inference")


def launch_argv(s: InferenceSettings) -> list[str]:
    """The `sglang.launch_server` command for these settings."""
    if s.port == 0:
        raise ValueError("engine=sglang needs a fixed port (SGLang cannot pick a free one and report it)")
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        f"--model-path={s.model_path}", f"--host={s.host}", f"--port={s.port}",
        f"--weight-version={s.weight_version}", f"--max-running-requests={s.max_batch_size}",
        f"--random-seed={s.seed}", "--enable-metrics",
    ]
    if s.skip_tokenizer_init:
        argv.append("--skip-tokenizer-init")
    if s.context_length:
        argv.append(f"--context-length={s.context_length}")
    if s.dtype != "float32":
        argv.append(f"--dtype={s.dtype}")
    api_key, admin_api_key = s.keys()  # on SGLang's command line: readable by this machine's users (docs/security.md)
    if api_key:
        argv.append(f"--api-key={api_key}")
    if admin_api_key:
        argv.append(f"--admin-api-key={admin_api_key}")
    return [*argv, *s.sglang_args]


def check_available() -> None:
    """Refuse at start, with the reason, where SGLang cannot run."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("engine=sglang: the sglang package is not installed (pip install 'sglang[all]' on a GPU machine)")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("engine=sglang: no CUDA GPU visible; use engine=cpu (the CPU server) here")


async def run_sglang(settings: InferenceSettings) -> None:
    check_available()
    argv = launch_argv(settings)
    log.info("starting SGLang", argv=[a.split("=")[0] + "=***" if a.startswith(("--api-key=", "--admin-api-key=")) else a for a in argv])
    proc = await asyncio.create_subprocess_exec(*argv)
    try:
        rc = await proc.wait()
    finally:
        if proc.returncode is None:  # we are being stopped: SGLang gets its shutdown time, then is killed
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), settings.shutdown_timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
    if rc != 0:
        raise RuntimeError(f"sglang.launch_server exited with {rc}")
