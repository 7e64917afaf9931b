"""SGLang's `/update_weights_from_tensor` on jetrl's server: weights handed over by a process on the
same host, by handle (`schemas/tensor_payload.py`: shared-memory files on the CPU, CUDA IPC
handles on a GPU), never through the HTTP body.

A request is SGLang's `UpdateWeightsFromTensorReqInput`: `serialized_named_tensors` (one entry per
tensor-parallel rank; this server has one, and reads the first), `load_format` (null or `direct`:
both mean "these names are the model's own"; `flattened_bucket` is refused), `flush_cache`,
`abort_all_requests`, `weight_version`. Every tensor of the request is checked against the model
(name and shape) off the model thread, then all are swapped in at once, between two decode steps, by
pointing each parameter at its new tensor, and the version set: no token is made by a mix of two
versions and generation is not paused. A refused request leaves the old weights serving.

jetrl's extra field `adopt: true` says the sender will not write the tensors' memory again until this
server reports a newer version (`services/weights/sender/shm_pool.py`): a CPU tensor of the model's dtype is
then served straight from the shared memory, with no copy. Without it (SGLang's meaning: the sender
may reuse its memory once answered), or when device or dtype differ, each tensor is copied into this
server's own memory first. `/begin_weight_update` and `/end_weight_update` (SGLang 0.5.23's session
around an update) are answered and need not be called: this server has no packed weights to restore.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from services.common.logging import get_logger

if TYPE_CHECKING:
    import torch

    from services.inference.scheduler import Scheduler

log = get_logger("inference.tensor_update")

PAGE = 4096


class TensorUpdateError(ValueError):
    """A request that cannot be taken; the old weights keep serving."""


class TensorUpdate:
    def __init__(self, scheduler: Callable[[], Scheduler]) -> None:
        self._scheduler = scheduler
        """The server's scheduler once it runs (the server builds it at start)."""
        self.updates = 0
        self.refused = 0
        self.kept: dict[str, torch.Tensor] = {}
        """The shared tensors the last swap replaced: kept mapped, so that when the sender hands the same
        memory over again (it alternates two sets) nothing is mapped anew or faulted in."""
        self._mapped: set[int] = set()
        """Data pointers of shared tensors this server has touched (its page tables hold them)."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/update_weights_from_tensor", self.update)
        router.add_post("/begin_weight_update", self.session)
        router.add_post("/end_weight_update", self.session)

    async def session(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "no weight-update session needed on this server"})

    async def update(self, request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError as exc:
            return _fail(f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _fail("request body must be a JSON object")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], str):
            return _fail("serialized_named_tensors: a non-empty list of base64 strings (one per tensor-parallel rank) is required")
        load_format = body.get("load_format")
        if load_format not in (None, "direct"):
            return _fail(f"load_format {load_format!r}: this server takes named tensors (null or 'direct') only")
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            await self._scheduler().abort(None)
        t0 = time.perf_counter()
        try:
            ready = await asyncio.to_thread(self._prepare, entries[0], bool(body.get("adopt", False)))
        except (TensorUpdateError, ValueError, RuntimeError) as exc:  # PayloadError is a ValueError
            self.refused += 1
            log.warning("tensor weight update refused; old weights keep serving", error=str(exc)[:300], version=version)
            return _fail(str(exc)[:500])
        prepare_s = time.perf_counter() - t0
        seconds, old = await self._scheduler().in_model_thread(self._swap, ready, None if version is None else str(version))
        self.kept = {n: t for n, t in old.items() if _cpu_shared(t)}
        self.updates += 1
        adopted = sum(1 for t in ready.values() if _cpu_shared(t))
        log.info("weights version received", transport="tensor", version=version, tensors=len(ready), adopted=adopted,
                 prepare_s=round(prepare_s, 4), swap_s=round(seconds, 6))
        return web.json_response({"success": True, "message": f"Success: {len(ready)} tensors ({adopted} adopted, "
                                  f"{len(ready) - adopted} copied); swapped in between two steps in {seconds:.6f}s"})

    def _prepare(self, entry: str, adopt: bool) -> dict[str, torch.Tensor]:
        """The request's tensors checked and ready to swap in (in a worker thread)."""
        import torch

        from schemas.tensor_payload import deserialize

        named = deserialize(entry)
        if not named:
            raise TensorUpdateError("serialized_named_tensors holds no tensors")
        targets = self._targets()
        for n, t in named:
            if n not in targets:
                raise TensorUpdateError(f"tensor the model does not have: {n}")
            if tuple(t.shape) != tuple(targets[n].shape):
                raise TensorUpdateError(f"shape mismatch for {n}: sent {tuple(t.shape)}, model {tuple(targets[n].shape)}")
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for n, t in named:
                target = targets[n]
                if adopt and _cpu_shared(t) and t.device == target.device and t.dtype == target.dtype:
                    self._touch(t)
                    out[n] = t
                else:  # SGLang's meaning: the sender may reuse its memory once this answers
                    out[n] = torch.empty_like(target).copy_(t)
            if any(t.device.type == "cuda" for t in out.values()):
                torch.cuda.synchronize()
        return out

    def _touch(self, t: torch.Tensor) -> None:
        """Fault a newly mapped shared tensor's pages in here, not in the model thread's next step."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._mapped:
            return
        flat = t.detach().reshape(-1).view(-1)
        stride = max(1, PAGE // t.element_size())
        float(flat[::stride].sum()) if t.is_floating_point() else int(flat[::stride].sum())
        self._mapped.add(ptr)

    def _targets(self) -> dict[str, torch.Tensor]:
        model = getattr(self._scheduler().backend, "model", None)
        if model is None:
            raise TensorUpdateError("this server has no model (simulate mode) to update")
        return {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}

    def _swap(self, tensors: dict[str, torch.Tensor], version: str | None) -> tuple[float, dict[str, torch.Tensor]]:
        """In the model thread, between two steps: each parameter pointed at its new tensor; returns how
        long decoding waited, and the tensors replaced."""
        t0 = time.perf_counter()
        targets = self._targets()
        old = {n: targets[n].data for n in tensors}
        for n, t in tensors.items():
            targets[n].data = t
        if version is not None:
            self._scheduler().backend.version = version
        live = {t.untyped_storage().data_ptr() for t in tensors.values()} | {
            t.untyped_storage().data_ptr() for t in old.values()}
        self._mapped &= live  # a mapping released is mapped (and faulted) anew if it comes back
        return time.perf_counter() - t0, old


def _cpu_shared(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_shared()


def _fail(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)
