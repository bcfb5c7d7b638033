"""The MoE layers of a whole-checkpoint run: verify or convert each, write it behind.

Each layer is verified (a recorded, still-valid layer is skipped) or converted, and its
file written, hashed and recorded on a writer thread while the next layer converts: writing
is mostly SHA-256 of the output, at one core's speed per stream, so one writer would fall
behind a GPU. At most `WRITES_IN_FLIGHT` converted layers wait in host memory. Each layer's
`converted` event carries its stage times.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from service.formats.checkpoint.converter import Converter, registry_converter
from service.formats.checkpoint.plan import CheckpointJob, MoELayerPlan
from service.formats.checkpoint.progress import CheckFn, Progress, RunTotals
from service.formats.checkpoint.records import UnitRecords
from service.formats.checkpoint.shards import Shards
from service.formats.io.safetensors import SafetensorsWriter, plan_of, tensor_bytes

__all__ = ["WRITES_IN_FLIGHT", "LayerConversion"]

#: Converted layers written at once by one run, each file by its own thread: writing is
#: mostly SHA-256 of the output (one stream per tensor, at one core's speed), so one writer
#: falls behind a GPU that converts a layer in milliseconds; each waiting layer holds its
#: converted tensors in host memory.
WRITES_IN_FLIGHT = 2


class LayerConversion:
    """Converts (or skips) this run's MoE layers, writing each on a writer thread."""

    def __init__(
        self,
        job: CheckpointJob,
        *,
        shards: Shards,
        records: UnitRecords,
        totals: RunTotals,
        report: Progress,
        check: CheckFn,
        converter: Converter | None,
    ) -> None:
        self.job = job
        self.shards = shards
        self.records = records
        self.totals = totals
        self.report = report
        self.check = check
        self._converter = converter
        #: The converter adds its own stages here; `convert` hands them on with the layer.
        self._layer_stages: dict[str, float] = {}
        #: Writes converted layers while the next is converted (bounded: WRITES_IN_FLIGHT).
        self._writer = ThreadPoolExecutor(WRITES_IN_FLIGHT, thread_name_prefix="checkpoint-write")
        self._pending: deque[Future[None]] = deque()

    def close(self) -> None:
        """Wait for the writes in flight (an aborted write removes its temp file first)."""
        self._writer.shutdown(wait=True, cancel_futures=True)

    @property
    def converter(self) -> Converter:
        if self._converter is None:
            self._converter = registry_converter(self.job, stages=self._layer_stages)
        return self._converter

    def prefetch(self, layer: MoELayerPlan) -> None:
        """Ask the kernel to read the layer's source pages ahead."""
        by_file: dict[str, list[str]] = {}
        for source in layer.tensors.values():
            by_file.setdefault(source.file, []).append(source.name)
        for file, names in by_file.items():
            self.shards[file].prefetch(names)

    def drain(self) -> None:
        """Wait for the layers being written (re-raising a write's error)."""
        self._wait_writes(0)

    def _wait_writes(self, most: int) -> None:
        """Wait until at most `most` layers are being written (re-raising a write's error)."""
        while len(self._pending) > most:
            self._pending.popleft().result()

    def convert(self, layer: MoELayerPlan) -> None:
        """Skip the layer if its record verifies, else convert it and queue its write."""
        bytes_in = sum(self.shards[t.file].entries[t.name].nbytes for t in layer.tensors.values())
        self.report("verifying", layer.file)
        began = time.perf_counter()
        record = self.records.verified(layer.unit, layer.files)
        verify = time.perf_counter() - began
        totals = self.totals
        if record is not None:
            with totals.lock:
                totals.skipped += 1
                totals.add_stages({"verify": verify})
            self.records.skip(layer.unit, record)
            self.report("skipped", layer.file, force=True, layers=1, nbytes=bytes_in)
            return
        self.report("converting", layer.module, force=True)
        sources = {key: self.shards[t.file].tensor(t.name) for key, t in layer.tensors.items()}
        converter = self.converter
        self._layer_stages.clear()
        began = time.perf_counter()
        tensors, descriptor = converter(layer, sources)
        seconds = time.perf_counter() - began
        totals.convert_seconds += seconds
        stages = {"verify": verify, **self._layer_stages, "convert": seconds}
        del sources
        self.check()
        began = time.perf_counter()
        self._wait_writes(WRITES_IN_FLIGHT - 1)
        stages["wait_write"] = time.perf_counter() - began
        self._pending.append(
            self._writer.submit(self._write, layer, tensors, descriptor, bytes_in, stages)
        )

    def _write(
        self,
        layer: MoELayerPlan,
        tensors: Mapping[str, Any],
        descriptor: dict[str, Any],
        bytes_in: int,
        stages: dict[str, float],
    ) -> None:
        """Write, hash (both at once: SafetensorsWriter), make durable and record one
        converted layer; its stage times go out with the `converted` event. `write_hash`
        is the writes, with the tensors' SHA-256s running beside them on hashing threads;
        `fsync_rename` includes waiting for the last of those hashes (overlapping the
        fsync)."""
        began = time.perf_counter()
        named = {f"{layer.module}.{name}": tensor for name, tensor in tensors.items()}
        path = self.job.output_dir / layer.file
        self.job.root.check(path.parent, "checkpoint.output_dir")
        metadata = {"format": "pt", "moe_control_backend": self.job.target.backend}
        with SafetensorsWriter(path, [plan_of(n, t) for n, t in named.items()], metadata) as out:
            for name, tensor in named.items():
                self.check()
                out.write(name, tensor_bytes(tensor))
                self.report("writing", name)
            wrote = time.perf_counter()
            stages["write_hash"] = wrote - began
            out.commit()
        committed = time.perf_counter()
        stages["fsync_rename"] = committed - wrote
        self.records.record(
            layer.unit,
            "moe",
            layer.file,
            layer.files,
            out,
            layer=layer.index,
            module=layer.module,
            num_experts=self.job.num_experts or layer.num_experts,
            descriptor=descriptor,
        )
        stages["journal"] = time.perf_counter() - committed
        totals = self.totals
        with totals.lock:
            totals.bytes_in += bytes_in
            totals.bytes_out += out.data_bytes
            totals.descriptor = totals.descriptor or descriptor
            totals.converted += 1
            totals.add_stages(stages)
        self.report(
            "converted",
            layer.file,
            force=True,
            extra={"stages": {name: round(value, 4) for name, value in stages.items()}},
            layers=1,
            nbytes=bytes_in,
        )
