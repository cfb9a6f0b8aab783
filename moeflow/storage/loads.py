"""The loads of an ``ExpertStore`` (``moeflow.storage.base``): copy jobs that fill fast-tier
slots from the home tier, the future of each slot's load in flight (``_loading``), the stall
spent waiting for one, and the loads nobody waits for any more (``_orphans``), so that every
failed load is reported exactly once (see ``ExpertStore``'s docstring).

``Loads`` is a mixin of ``ExpertStore``: it uses the store's ``config``, ``device``, ``disk``,
``engine``, ``stats``, ``_loading``, ``_orphans``, ``_forget_slot`` and ``_forget_all``.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from moeflow.storage.home import padded
from moeflow.storage.tiers import aligned_empty, tensor_bytes

__all__ = ["Loads", "Copy", "DiskBlock", "add_note"]

# a block of the disk tier: (the file's key of a tensor, one expert's row of it or None: all)
DiskBlock = tuple[str, int | None]
# one copy of a load: (fast-tier destination, home source, the source's disk block or None)
Copy = tuple[torch.Tensor, torch.Tensor, DiskBlock | None]


class Loads:
    """The load machinery every fast-tier layout shares (a mixin of ``ExpertStore``)."""

    def _staging_buffers(self, count: int, nbytes: int) -> list[torch.Tensor | None]:
        """Per slot, the pinned host buffer of ``nbytes`` a disk read lands in before its copy
        to the GPU (CUDA with a disk tier only; on CPU, reads go straight into the slot)."""
        if self.device.type != "cuda" or self.disk is None:
            return [None] * count
        return [aligned_empty(nbytes, device=torch.device("cpu"), pin_memory=True) for _ in range(count)]

    def _copy_job(self, pairs: list[Copy], staging: torch.Tensor | None, after: torch.cuda.Event | None):
        """A job for the copy engine: ``dst.copy_(src)`` for each ``(dst, src, disk range)``.

        On CUDA the device copies wait for ``after`` (the consumer released the destination),
        read disk sources through the pinned ``staging`` buffer, and the job returns the event
        that marks them done. On CPU every copy is done when the job returns. Disk reads are
        checked (``DiskFile.read``) before the bytes go on to the device.
        """
        disk = self.disk
        evict = disk is not None and self.config.evict_page_cache

        def job(stream: torch.cuda.Stream | None):
            if stream is not None and after is not None:
                stream.wait_event(after)
            offset = 0
            for dst, src, block in pairs:
                if block is None:  # host -> fast
                    dst.copy_(src, non_blocking=stream is not None)
                    continue
                if stream is None:  # disk -> host memory (the CPU fast tier) directly
                    disk.read(dst, *block)
                else:  # disk -> pinned staging (this thread) -> device (copy stream)
                    n = tensor_bytes(dst)
                    stage = staging[offset : offset + n].view(dst.dtype).view(dst.shape)
                    offset += padded(n)
                    disk.read(stage, *block)
                    dst.copy_(stage, non_blocking=True)
                if evict:
                    disk.evict(*disk.byte_range(*block))
            if stream is None:
                return None
            done = torch.cuda.Event()
            done.record(stream)
            if staging is not None:
                done.synchronize()  # the next job into this slot reuses the staging buffer
            return done

        return job

    def _start_load(self, slot: int, pairs: list[Copy], staging: torch.Tensor | None,
                    after: torch.cuda.Event | None, *, prefetch: bool) -> None:
        """Queue the copies that fill slot ``slot`` and count them; a load still in flight into
        that slot is retired (nobody will wait for it)."""
        self._retire(self._loading.pop(slot, None))
        self._loading[slot] = self.engine.submit(self._copy_job(pairs, staging, after))
        nbytes = sum(tensor_bytes(dst) for dst, _, _ in pairs)
        s = self.stats
        s.loads += 1
        s.prefetch_loads += prefetch
        s.bytes_loaded += nbytes
        s.bytes_from_disk += nbytes if self.disk is not None else 0

    def _await_load(self, slot: int) -> None:
        """Wait for slot ``slot``'s load if one is in flight; if it failed, forget the slot and
        raise the error, carrying the failures of the other loads as notes (``_settle``)."""
        future = self._loading.pop(slot, None)
        if future is None:
            return
        try:
            self._wait(future)
        except BaseException as err:
            self._forget_slot(slot)
            if isinstance(err, Exception):  # the load's failure (not a Ctrl-C during the wait)
                self._settle(err)
            raise

    def _settle(self, error: BaseException) -> None:
        """``error``, a failed load, is about to reach the caller that waited for it: wait for
        the other loads in flight and the retired ones, forget the slots of those that failed
        and add their errors to ``error`` as notes. The caller's call ends there, so nobody
        would wait for them now; without this, ``close`` would raise them as failures nobody
        saw, after the caller was told (usually the same damage of the same file). The loads
        that succeeded stay, for their slots' next use. Costs a wait on the failure path only."""
        for slot, future in list(self._loading.items()):
            failure = _failure(future)
            if failure is not None:
                del self._loading[slot]
                self._forget_slot(slot)
                add_note(error, f"another load of this store failed too: {failure!r}")
        kept = []
        for future in self._orphans:
            failure = _failure(future)
            if failure is None:
                kept.append(future)
            else:
                add_note(error, f"a load nobody waited for failed too: {failure!r}")
        self._orphans = kept

    def _wait(self, future: Future) -> None:
        self.stats.stall_s += self.engine.wait(future)

    def _release_event(self) -> torch.cuda.Event | None:
        """On CUDA, an event marking the compute stream's work so far (a copy into a slot the
        compute just read waits on it); ``None`` on CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _retire(self, future: Future | None) -> None:
        """A load nobody will wait for (its slot was reclaimed or forgotten): kept so that its
        failure is not lost (the next failure raised to a caller carries it, else ``close``
        raises it)."""
        if future is not None:
            self._orphans.append(future)
            self._orphans = [f for f in self._orphans if not (f.done() and f.exception() is None)]

    @staticmethod
    def _drain(futures: list[Future]) -> None:
        """Wait for ``futures`` (host and, on CUDA, device side) and raise the first error,
        the later ones added to it as notes."""
        error: BaseException | None = None
        for future in futures:
            try:
                result = future.result()
                if isinstance(result, torch.cuda.Event):
                    result.synchronize()
            except BaseException as err:  # noqa: BLE001 - re-raised below
                if error is None:
                    error = err
                else:
                    add_note(error, f"another load of this store failed too: {err!r}")
        if error is not None:
            raise error

    def _in_flight(self) -> list[Future]:
        """Every copy job ``close`` must wait for."""
        return [*self._orphans, *self._loading.values()]

    def invalidate(self) -> None:
        """Forget every slot's contents (the home weights changed, e.g. after an optimizer
        step); waits for loads in flight (on CUDA, on the host too: their copies are done when
        it returns) and raises the first of their errors (the others as its notes), after
        forgetting every slot. Retired loads are left to ``close`` (or the next failure)."""
        pending = list(self._loading.values())
        self._loading.clear()
        self._forget_all()
        self._drain(pending)


def _failure(future: Future) -> BaseException | None:
    """The error of the copy job ``future`` (waiting for it to finish), or ``None``."""
    try:
        return future.exception()
    except BaseException as err:  # noqa: BLE001 - cancelled: that is its failure
        return err


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``: Python 3.11+; on 3.10 the ``__notes__`` list it fills (PEP
    678), which tracebacks there do not print but which stays on the error."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]
