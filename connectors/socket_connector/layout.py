"""Where each KV block lives in memory, and views onto it for the wire.

vLLM hands a connector one tensor per attention layer. Whatever the backend's
logical shape (CPU: ``[num_blocks, kv_heads, block_size, 2*head]``; CUDA flash
attention: ``[2, num_blocks, block_size, kv_heads, head]``, possibly with a
stride order), the memory is dense, so after ordering the dimensions by stride
every layer is an ``(outer, num_blocks, inner)`` byte array: a block is
``outer`` contiguous segments of ``inner`` bytes. The byte stream for a list of
blocks is, per chunk of blocks: for each layer (sorted by name), for each
outer index, each block's segment in list order. Both sides derive it from the
block ids alone, so the data needs no per-block headers.

Two stores implement the views: ``DirectStore`` (host memory: CPU KV caches,
sent from and received into the tensors themselves) and ``StagedStore``
(accelerator memory: blocks gathered into / scattered from pinned host
buffers, one chunk at a time).
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .wire import coalesce


class LayoutError(ValueError):
    """A KV cache tensor this connector cannot address block by block."""


@dataclass(frozen=True)
class LayerLayout:
    """One layer's KV cache as an ``(outer, num_blocks, seg_bytes)`` byte array."""

    name: str
    outer: int
    num_blocks: int
    seg_bytes: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in this layer."""
        return self.outer * self.seg_bytes

    def extents(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, length) of the given blocks in wire order, adjacent ones merged."""
        raw = [
            ((o * self.num_blocks + b) * self.seg_bytes, self.seg_bytes)
            for o in range(self.outer)
            for b in block_ids
        ]
        return coalesce(raw)


@dataclass(frozen=True)
class KVLayout:
    """Every layer's layout; equal layouts on both sides make the stream well defined."""

    layers: tuple[LayerLayout, ...]
    #: how blocks are encoded on the wire (wireformat.py): "raw" (the cache's own bytes) or "fp8"
    wire: str = "raw"

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return sum(layer.block_bytes for layer in self.layers)

    def fingerprint(self) -> list[list[object]]:
        """A JSON-able summary both sides compare before any data moves.

        A non-raw wire format adds a last ``["wire", name]`` entry (a raw layout's
        summary is what it was before wire formats existed)."""
        out: list[list[object]] = [[layer.name, layer.outer, layer.seg_bytes] for layer in self.layers]
        if self.wire != "raw":
            out.append(["wire", self.wire])
        return out

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        """Raise LayoutError for a block id outside the cache."""
        limit = min((layer.num_blocks for layer in self.layers), default=0)
        bad = [b for b in block_ids if not 0 <= b < limit]
        if bad:
            raise LayoutError(f"block ids out of range [0, {limit}): {bad[:8]}")


def block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The dimension indexing blocks: of those sized ``num_blocks``, the outermost in memory.

    When the attention kernel splits each block into smaller kernel blocks the
    dimension is ``num_blocks * ratio``; a logical block is then ``ratio``
    adjacent kernel blocks.
    """
    candidates = [d for d in range(tensor.ndim) if tensor.shape[d] == num_blocks]
    if not candidates:
        candidates = [d for d in range(tensor.ndim) if tensor.shape[d] % num_blocks == 0 and tensor.shape[d]]
    if not candidates:
        raise LayoutError(f"no dimension of size num_blocks={num_blocks} in KV cache of shape {tuple(tensor.shape)}")
    return max(candidates, key=lambda d: tensor.stride(d))


def as_block_bytes(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a layer's KV cache as a uint8 ``(outer, num_blocks, inner_bytes)`` tensor (no copy)."""
    bd = block_dim(tensor, num_blocks)
    # Physical order: larger strides first; the block dim wins ties so that
    # size-1 dims never land in front of it by accident.
    order = sorted(range(tensor.ndim), key=lambda d: (-tensor.stride(d), d != bd))
    physical = tensor.permute(order)
    if not physical.is_contiguous():
        raise LayoutError(
            f"KV cache of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not dense; "
            "the socket connector needs each layer in one dense allocation"
        )
    pos = order.index(bd)
    outer = math.prod(physical.shape[:pos])
    inner = math.prod(physical.shape[pos:]) * tensor.element_size() // num_blocks
    return physical.reshape(-1).view(torch.uint8).view(outer, num_blocks, inner)


def _transferred(kv_caches: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer's cache in wire order (sorted by name); layers sharing one tensor (KV sharing)
    only the first time."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name in sorted(kv_caches):
        tensor = kv_caches[name]
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            yield name, tensor


def describe(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """The layout of vLLM's KV caches plus each layer's byte view, in wire order.

    Layers that share one tensor (KV sharing) are transferred once. ``views[i].dtype`` is uint8;
    the cache's own element type is ``kv_dtypes(kv_caches)[i]``.
    """
    layers: list[LayerLayout] = []
    views: list[torch.Tensor] = []
    for name, tensor in _transferred(kv_caches):
        view = as_block_bytes(tensor, num_blocks)
        layers.append(LayerLayout(name, view.shape[0], num_blocks, view.shape[2]))
        views.append(view)
    if not layers:
        raise LayoutError("no KV cache tensors were registered")
    return KVLayout(tuple(layers)), views


def kv_dtypes(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.dtype]:
    """Each transferred layer's element type, in the order of :func:`describe`'s views."""
    return [tensor.dtype for _, tensor in _transferred(kv_caches)]


def host_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview onto a dense host tensor's bytes (no copy)."""
    if tensor.device.type != "cpu":
        raise LayoutError(f"cannot map {tensor.device} memory directly")
    if not tensor.is_contiguous():
        raise LayoutError("cannot map a non-contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class BlockStore(ABC):
    """Memory the wire reads blocks from (prefill side) or writes them into (decode side)."""

    layout: KVLayout

    @property
    def staged_bytes(self) -> int:
        """Bytes of host staging buffers this store holds (0: it reads and writes the cache itself)."""
        return 0

    def message_layers(self) -> list[list[int] | None]:
        """How a fetch message of whole blocks is read and written (by the listener's fetch and the
        client's): ``[None]``, all layers at once (the cache's own memory: one scatter-gather call
        per message), or one layer at a time for stores that stage (convert or copy) their bytes, so
        that layer l+1 converts while layer l is on the wire and D converts layer l while l+1
        arrives. The wire bytes are the same either way (a message is its layers in order)."""
        return [None]

    @abstractmethod
    @contextmanager
    def reading(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        """Views holding ``block_ids`` in wire order, valid inside the block; ``layers`` (indices into
        ``layout.layers``, in the order given): only those layers (a streamed message), else all."""

    @abstractmethod
    @contextmanager
    def writing(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        """Views to fill with ``block_ids`` in wire order (``layers`` as in :meth:`reading`);
        committed when the block exits cleanly."""


class DirectStore(BlockStore):
    """Host KV caches: the views are the tensors' own memory."""

    def __init__(self, layout: KVLayout, views: Sequence[torch.Tensor]):
        self.layout = layout
        self._keep = list(views)  # keeps the tensors (and their memory) alive
        self._regions = [host_memoryview(v) for v in views]

    def _views(self, block_ids: Sequence[int], layers: Sequence[int] | None) -> list[memoryview]:
        self.layout.check_blocks(block_ids)
        out: list[memoryview] = []
        for i in _layer_indices(self.layout, layers):
            region = self._regions[i]
            out.extend(region[off : off + length] for off, length in self.layout.layers[i].extents(block_ids))
        return out

    @contextmanager
    def reading(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        yield self._views(block_ids, layers)

    @contextmanager
    def writing(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        yield self._views(block_ids, layers)


def _layer_indices(layout: KVLayout, layers: Sequence[int] | None) -> Sequence[int]:
    """``layers`` checked against ``layout`` (every layer when None); raises LayoutError."""
    if layers is None:
        return range(len(layout.layers))
    bad = [i for i in layers if not 0 <= i < len(layout.layers)]
    if bad:
        raise LayoutError(f"layer indices out of range [0, {len(layout.layers)}): {bad[:8]}")
    return layers


@dataclass
class _Held:
    """One thread's staging buffer (flat bytes)."""

    buf: torch.Tensor


class StagingBuffers:
    """Per-thread host buffers for stores whose wire bytes are not the cache's own memory
    (:class:`StagedStore`, :class:`~.wireformat.Fp8Store`), so that parallel streams never share one.

    Each thread holds one flat buffer, grown on demand to what one read or write needs, and
    :meth:`get` carves from it one dense ``(outer, blocks, seg_bytes)`` uint8 tensor per layer that
    read or write moves. Those stores move one layer per message (:meth:`StagedStore.message_layers`),
    so a thread holds one layer's message, not every layer's (a buffer per layer held 32 x that
    for a Llama-3.1-8B cache: 69 MB of pinned memory per thread with 4 MiB fp8 messages)."""

    def __init__(self, layers: Sequence[LayerLayout], pin: bool):
        self._shapes = [(layer.outer, layer.seg_bytes) for layer in layers]
        self._pin = pin
        self._local = threading.local()
        self._lock = threading.Lock()
        #: bytes allocated over all threads (a buffer lives as long as its thread)
        self.allocated = 0

    def get(self, nblocks: int, layers: Sequence[int]) -> list[torch.Tensor]:
        """This thread's buffers for ``nblocks`` blocks of each of ``layers`` (indices), in that order."""
        sizes = [self._shapes[i][0] * nblocks * self._shapes[i][1] for i in layers]
        need = sum(sizes)
        held: _Held | None = getattr(self._local, "held", None)
        if held is None or held.buf.numel() < need:
            held = _Held(torch.empty(need, dtype=torch.uint8, pin_memory=self._pin))
            with self._lock:
                self.allocated += need
            # counted out when the buffer goes: replaced by a larger one, or its thread ended
            weakref.finalize(held, self._freed, need)
            self._local.held = held
        out: list[torch.Tensor] = []
        offset = 0
        for i, size in zip(layers, sizes, strict=True):
            outer, seg = self._shapes[i]
            out.append(held.buf[offset : offset + size].view(outer, nblocks, seg))
            offset += size
        return out

    def _freed(self, size: int) -> None:
        with self._lock:
            self.allocated -= size

    @staticmethod
    def views(host: Sequence[torch.Tensor]) -> list[memoryview]:
        """The wire's views of buffers from :meth:`get`, in wire order."""
        return [host_memoryview(h[o]) for h in host for o in range(h.shape[0])]


class StagedStore(BlockStore):
    """KV caches whose wire bytes pass through host staging buffers, one chunk at a time:
    accelerator caches (pinned buffers), and subclasses that convert (:class:`~.wireformat.Fp8Store`).

    ``_dev[i]`` is layer i's cache as an ``(outer, num_blocks, x)`` tensor; :meth:`_pack` puts
    the selected blocks into a staging buffer, :meth:`_unpack` the other way (here: plain copies).
    """

    def __init__(self, layout: KVLayout, views: Sequence[torch.Tensor], pin: bool = True):
        self.layout = layout
        self._dev = list(views)
        self._staging = StagingBuffers(layout.layers, pin and torch.cuda.is_available())

    @property
    def staged_bytes(self) -> int:
        return self._staging.allocated

    def message_layers(self) -> list[list[int] | None]:
        return [[i] for i in range(len(self.layout.layers))]

    def _pack(self, blocks: torch.Tensor, host: torch.Tensor) -> None:
        """Write ``blocks`` (one layer's selected blocks) into ``host`` (its staging buffer)."""
        host.copy_(blocks, non_blocking=False)

    def _unpack(self, host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The blocks ``host`` holds, as ``like``'s dtype on ``like``'s device."""
        return host.to(like.device, non_blocking=False)

    def _verify(self, host: torch.Tensor, like: torch.Tensor) -> None:
        """Raise (a :class:`~.wire.WireError`) when the received bytes in ``host`` must not reach
        ``like``'s cache; :meth:`writing` asks this of every layer of a message before it writes any.
        Plain copies accept any bytes; :class:`~.wireformat.Fp8Store` checks its scales."""

    @contextmanager
    def reading(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        self.layout.check_blocks(block_ids)
        which = _layer_indices(self.layout, layers)
        host = self._staging.get(len(block_ids), which)
        for h, i in zip(host, which, strict=True):
            d = self._dev[i]
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=d.device)
            self._pack(d.index_select(1, idx), h)
        yield self._staging.views(host)

    @contextmanager
    def writing(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> Iterator[list[memoryview]]:
        self.layout.check_blocks(block_ids)
        which = _layer_indices(self.layout, layers)
        host = self._staging.get(len(block_ids), which)
        yield self._staging.views(host)
        for h, i in zip(host, which, strict=True):   # a refused message writes nothing
            self._verify(h, self._dev[i])
        for h, i in zip(host, which, strict=True):
            d = self._dev[i]
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=d.device)
            d.index_copy_(1, idx, self._unpack(h, d))
        if any(self._dev[i].device.type == "cuda" for i in which):
            torch.cuda.synchronize()


def make_store(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, wire: str = "raw") -> BlockStore:
    """The right store for where vLLM put the KV caches and the wire format asked for
    (``"fp8"``: :class:`~.wireformat.Fp8Store`, which works on host and device caches alike)."""
    layout, views = describe(kv_caches, num_blocks)
    if wire == "fp8":
        from .wireformat import Fp8Store  # the format builds on this module's layouts

        return Fp8Store(layout, views, kv_dtypes(kv_caches))
    if wire != "raw":
        raise LayoutError(f"unknown wire format {wire!r}")
    if all(v.device.type == "cpu" for v in views):
        return DirectStore(layout, views)
    return StagedStore(layout, views)
