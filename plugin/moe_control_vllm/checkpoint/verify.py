"""Checking converted tensors against the manifest's SHA-256s, beside the loading.

SHA-256 runs at one core's speed (1-2 GB/s), and a Mixtral-8x7B's experts are 23 GB: hashed
in the loading thread, the check would cost vLLM more start-up than the repack it replaces.
hashlib releases the GIL, so the tensors are hashed on a small pool of threads while vLLM
goes on reading the next ones, and each layer waits for its own digests before it is put
together (`Verifier.check`, from `process_weights_after_loading`). A tensor is hashed as
vLLM's loader handed it over (its safetensors loader gives a fresh tensor per name).

``MOE_CONTROL_VERIFY=shapes`` skips the hashing (dtypes and shapes are still checked, and
the manifest's own SHA-256 always is); the default is ``sha256``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moe_control_vllm.checkpoint.manifest import ConvertedCheckpointError, TensorRecord

__all__ = ["MODES", "Verifier", "hashes_tensors", "tensor_sha256"]

#: ``MOE_CONTROL_VERIFY`` values: hash every tensor, or check dtypes and shapes only.
MODES = ("sha256", "shapes")

#: Threads hashing at once (each hashes one tensor at one core's speed).
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))

_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def hashes_tensors() -> bool:
    """Whether tensors are hashed (``MOE_CONTROL_VERIFY``; unknown values are refused)."""
    mode = os.environ.get("MOE_CONTROL_VERIFY", "sha256")
    if mode not in MODES:
        raise ConvertedCheckpointError(f"MOE_CONTROL_VERIFY={mode!r}: expected one of {MODES}")
    return mode == "sha256"


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in its logical order: what the manifest records."""
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    data = host.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.data).hexdigest()


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="moe-control-sha"))
        return _POOL[0]


class Verifier:
    """The digests of one layer's tensors, computed in the background."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.enabled = hashes_tensors()
        self._pending: dict[str, tuple[TensorRecord, Future[str]]] = {}

    def submit(self, record: TensorRecord, tensor: torch.Tensor) -> None:
        """Start hashing `tensor` (held until it is hashed)."""
        if self.enabled:
            self._pending[record.name] = (record, _pool().submit(tensor_sha256, tensor))

    def check(self) -> None:
        """Wait for the digests; a tensor whose bytes are not the manifest's is refused."""
        pending, self._pending = self._pending, {}
        for record, future in pending.values():
            digest = future.result()
            if digest != record.sha256:
                raise ConvertedCheckpointError(
                    f"{record.checkpoint_name}: SHA-256 {digest} does not match the "
                    f"manifest's {record.sha256}: {self.file} is damaged or was changed "
                    "after the conversion"
                )
