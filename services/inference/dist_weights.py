"""SGLang's distributed weight update on the CPU server: `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`, `/get_weights_by_name`.

The trainer's sending rank (rank 0) broadcasts each tensor of a bucket, in the order of `names`, over
a gloo group that this server joined at `rank_offset`. Receiving runs in its own thread, so decoding
goes on while the bytes arrive; the bucket lands in fresh buffers, is checked in a second thread
(names, shapes and, when the request carries one, the `checksum` jetrl sends alongside) while the
next bucket arrives, converted to the model's dtype, and held. The bucket that carries a
`weight_version` swaps every held bucket of the version into the live model at once, in the model
thread, i.e. between two decode steps, by pointing each parameter at its new tensor: no token is
ever made by a mix of two versions and generation is not paused. Any failure drops what was held;
the old weights keep serving.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.common.logging import get_logger

if TYPE_CHECKING:  # torch is imported on first use, so a simulated server never pays for it
    import torch

    from services.inference.scheduler import Scheduler

log = get_logger("inference.dist_weights")

DEFAULT_GROUP = "weight_update_group"


class DistUpdateError(ValueError):
    """A bucket that cannot be taken; the old weights still serve."""


def parse_dtype(name: str) -> torch.dtype:
    import torch

    candidate = name.split(".", 1)[1] if name.startswith("torch.") else name
    dtype = getattr(torch, candidate, None)
    if not isinstance(dtype, torch.dtype):
        raise DistUpdateError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class Group:
    name: str
    rank: int
    world_size: int
    store: Any
    pg: Any
    receiver: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="weights-recv"))
    """Receives run here, in order, off the model thread. One per group: a receive stuck on a broken
    group (until its deadline) must not hold up the group that replaces it."""
    checker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="weights-check"))
    """Checks (names, shapes, checksum) and dtype conversion run here, in order, while the receiver
    takes the next bucket."""
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    """Received, verified tensors of the version in flight, swapped in by its last bucket."""
    timing: dict[str, float] = field(default_factory=lambda: {"receive_s": 0.0, "check_s": 0.0})
    """Seconds spent receiving and checking the version in flight (logged with its swap)."""
    spoiled: str = ""
    """Why a bucket of the version in flight was refused: the rest of the version is received (the
    group stays in step) but refused too, so a partial version is never swapped in."""


class DistWeights:
    def __init__(self, scheduler: Callable[[], Scheduler], timeout_s: float) -> None:
        self._scheduler = scheduler
        """The server's scheduler once it runs (the server builds it at start)."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: dict[str, Group] = {}
        self.buckets_received = 0
        self.buckets_refused = 0
        self.spare: dict[str, torch.Tensor] = {}
        """The storage of the weights the last swap replaced, by name: the next version is received
        straight into it (same name, shape and dtype), so a version costs no allocation, no page
        faults on fresh memory and no unmapping of the old weights (at 1 GB those cost more than the
        copy itself). Nothing else references it once swapped out."""
        self._received: set[int] = set()
        """Data pointers of the tensors the last swap put in (memory this class allocated): only those
        are reused. The weights the server loaded at start may be a file's read-only mapping."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/init_weights_update_group", self.init_group)
        router.add_post("/update_weights_from_distributed", self.update)
        router.add_post("/destroy_weights_update_group", self.destroy)
        router.add_get("/get_weights_by_name", self.get_weights_by_name)  # GET and POST, as SGLang serves it
        router.add_post("/get_weights_by_name", self.get_weights_by_name)

    # ---- group ---------------------------------------------------------------------------------
    async def init_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            addr, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            return _fail(f"init_weights_update_group needs master_address, master_port, rank_offset, world_size: {exc!r}")
        name = str(body.get("group_name", DEFAULT_GROUP))
        backend = str(body.get("backend", "nccl"))
        if backend != "gloo":
            return _fail(f"backend {backend!r}: the CPU server joins weight-update groups over gloo only")
        if not 0 < rank < world:
            return _fail(f"rank_offset {rank} outside 1..{world - 1} (rank 0 is the trainer)")
        if getattr(self._scheduler().backend, "model", None) is None:
            return _fail("this server has no model (simulate mode): it cannot take weights")
        self._drop(name)
        try:
            group = await asyncio.to_thread(self._join, name, addr, port, rank, world)
        except Exception as exc:  # rendezvous timeout, refused connection: say which
            log.warning("joining the weight-update group failed", group=name, error=repr(exc))
            return _fail(f"joining group {name!r} at {addr}:{port} failed: {exc}")
        self.groups[name] = group
        log.info("joined weight-update group", group=name, rank=rank, world_size=world, master=f"{addr}:{port}")
        return web.json_response({"success": True, "message": f"joined {name} as rank {rank} of {world}"})

    def _join(self, name: str, addr: str, port: int, rank: int, world: int) -> Group:
        import torch.distributed as dist

        store = dist.TCPStore(addr, port, world, is_master=False, timeout=self.timeout)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, world, self.timeout)
        return Group(name=name, rank=rank, world_size=world, store=store, pg=pg)

    async def destroy(self, request: web.Request) -> web.Response:
        name = str((await _body(request)).get("group_name", DEFAULT_GROUP))
        if not self._drop(name):
            return _fail(f"no weight-update group {name!r}")
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    def _drop(self, name: str) -> bool:
        group = self.groups.pop(name, None)
        if group is None:
            return False
        if group.held:
            log.warning("weight-update group destroyed with buckets held; they are dropped", group=name, held=len(group.held))
        group.held.clear()
        group.receiver.shutdown(wait=False, cancel_futures=True)
        group.checker.shutdown(wait=False, cancel_futures=True)
        log.info("left weight-update group", group=name)
        return True

    # ---- buckets -------------------------------------------------------------------------------
    async def update(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = str(body.get("group_name", DEFAULT_GROUP))
        group = self.groups.get(name)
        if group is None:
            return _fail(f"no weight-update group {name!r}: call /init_weights_update_group first")
        try:
            names, dtypes, shapes = list(body["names"]), [parse_dtype(str(d)) for d in body["dtypes"]], list(body["shapes"])
            if not names or not (len(names) == len(dtypes) == len(shapes)):
                raise DistUpdateError(f"names, dtypes, shapes: empty or of different lengths ({len(names)}, {len(dtypes)}, {len(shapes)})")
        except (KeyError, TypeError, ValueError) as exc:
            return _fail(f"update_weights_from_distributed: bad request: {exc}")
        version = body.get("weight_version")
        try:
            buffers = self._buffers(names, dtypes, shapes)
        except (TypeError, ValueError, RuntimeError) as exc:
            return _fail(f"update_weights_from_distributed: bad shapes: {exc}")
        try:
            # Always receive what was announced, even if it will be refused: the sender broadcasts
            # it anyway, and a member that skips a broadcast desynchronises the group.
            await asyncio.get_running_loop().run_in_executor(group.receiver, self._receive, group, buffers)
        except Exception as exc:
            group.held.clear()
            self.buckets_refused += 1
            log.warning("receiving a bucket failed; old weights keep serving", group=name, error=repr(exc))
            return _fail(f"receiving the bucket failed: {str(exc)[:300]}")
        try:
            # Checked in the group's second thread, so the next bucket is received meanwhile. Both
            # threads take buckets in order, so when this returns every earlier bucket of the version
            # has been checked and its handler has run (held it, or marked the version spoiled).
            ready = await asyncio.get_running_loop().run_in_executor(
                group.checker, self._verify, group, names, buffers, body.get("checksum"))
            if group.spoiled:
                raise DistUpdateError(f"an earlier bucket of this version was refused ({group.spoiled})")
            group.held.update(zip(names, ready, strict=True))
            swapped = ""
            if version is not None:
                held, group.held = group.held, {}
                seconds, old = await self._scheduler().in_model_thread(self._swap_in, held, str(version))
                log.info("weights version received", version=version, tensors=len(held), swap_s=round(seconds, 6),
                         **{k: round(v, 4) for k, v in group.timing.items()})
                group.timing = {k: 0.0 for k in group.timing}
                # the next version lands in the memory of the one before this (when it was ours)
                self.spare = {n: t for n, t in old.items() if t.data_ptr() in self._received}
                self._received = {t.data_ptr() for t in held.values()}
                swapped = f"; version {version} swapped in ({len(held)} tensors) between two steps in {seconds:.6f}s"
        except DistUpdateError as exc:
            group.held.clear()
            if version is not None:  # the version's last bucket: the next version starts clean
                group.spoiled = ""
            elif not group.spoiled:
                group.spoiled = str(exc)
            self.buckets_refused += 1
            log.warning("bucket refused; old weights keep serving", group=name, error=str(exc), version=version)
            return _fail(str(exc))
        self.buckets_received += 1
        return web.json_response({"success": True, "message": f"received {len(names)} tensors{swapped}"})

    def _buffers(self, names: list[str], dtypes: list[torch.dtype], shapes: list[Any]) -> list[torch.Tensor]:
        """Where the bucket lands: the spare storage of each tensor when it fits, else fresh memory."""
        import torch

        out = []
        for n, d, s in zip(names, dtypes, shapes, strict=True):
            shape = [int(x) for x in s]
            spare = self.spare.pop(n, None)
            fits = spare is not None and spare.dtype == d and list(spare.shape) == shape
            out.append(spare if fits and spare is not None else torch.empty(shape, dtype=d))
        return out

    def _receive(self, group: Group, buffers: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        # queued all at once, then waited for (gloo keeps their order): one GIL take per bucket
        works = [group.pg.broadcast(t, 0) for t in buffers]
        for w in works:
            w.wait()
        group.timing["receive_s"] += time.perf_counter() - t0  # this thread's key only

    def _verify(self, group: Group, names: list[str], buffers: list[torch.Tensor], checksum: Any) -> list[torch.Tensor]:
        """In the group's checking thread: names, shapes and checksum checked; each tensor in the
        model's dtype, ready to be swapped in."""
        t0 = time.perf_counter()
        try:
            return self._checked(names, buffers, checksum)
        finally:
            group.timing["check_s"] += time.perf_counter() - t0  # this thread's key only

    def _checked(self, names: list[str], buffers: list[torch.Tensor], checksum: Any) -> list[torch.Tensor]:
        targets = self._targets()
        for n, t in zip(names, buffers, strict=True):
            if n not in targets:
                raise DistUpdateError(f"tensor the model does not have: {n}")
            if tuple(t.shape) != tuple(targets[n].shape):
                raise DistUpdateError(f"shape mismatch for {n}: sent {tuple(t.shape)}, model {tuple(targets[n].shape)}")
        if checksum is not None:
            from schemas.bucket_checksum import check_bucket

            why = check_bucket(buffers, str(checksum))
            if why is not None:
                raise DistUpdateError(f"{why} ({len(names)} tensors from {names[0]})")
        return [t if t.dtype == targets[n].dtype else t.to(targets[n].dtype) for n, t in zip(names, buffers, strict=True)]

    def _model(self) -> Any:
        model = getattr(self._scheduler().backend, "model", None)
        if model is None:
            raise DistUpdateError("this server has no model (simulate mode) to update")
        return model

    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by name, tied ones under each of their names."""
        model = self._model()
        return {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}

    def _state(self) -> dict[str, torch.Tensor]:
        return dict(self._model().state_dict())

    def _swap_in(self, tensors: dict[str, torch.Tensor], version: str) -> tuple[float, dict[str, torch.Tensor]]:
        """In the model thread, between two steps; returns how long decoding waited for it, and the
        old weights by name (the next version's receive buffers). The received tensors become the
        parameters' storage (no copy): the wait is a pointer per tensor."""
        t0 = time.perf_counter()
        targets = self._targets()
        old = {n: targets[n].data for n in tensors}
        for n, t in tensors.items():
            targets[n].data = t
        self._scheduler().backend.version = version
        return time.perf_counter() - t0, old

    # ---- inspection ----------------------------------------------------------------------------
    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await _body(request) if request.method == "POST" else dict(request.query)
        name = body.get("name")
        if not name:
            return web.json_response({"error": {"message": "name is required"}}, status=400)
        truncate = int(body.get("truncate_size", 100))
        try:
            state = self._state()
        except DistUpdateError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if name not in state:
            return web.json_response({"error": {"message": f"no parameter {name!r}"}}, status=400)
        param = await self._scheduler().in_model_thread(lambda: state[name][:truncate].detach().clone())
        return web.json_response(param.tolist())


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _fail(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)
