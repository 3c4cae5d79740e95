"""The decoders' KV cache: each layer keeps its keys and values in a buffer with spare columns.

transformers' DynamicLayer appends with torch.cat, so every forward copies every layer's whole cache,
and after a block step's crop the next forward copies the cropped view again. A block-diffusion step
crops and re-appends a 32-column window against a cache of 500-1,100 columns many times a block, so
those copies are a real share of its cost on a CPU. Here an append writes the new columns into the
buffer, a crop moves the end back, and attention gets views of the used columns. A full buffer is
replaced by one of twice the columns needed (a Beauty decode: the prefill's buffer already holds the
whole answer), so a cache holds up to twice its keys' memory: fine on a CPU service, a capacity hint
would be the change for large GPU batches.

Decode only: the next append overwrites columns a crop gave back, so a tensor kept from an earlier
forward (an autograd graph, say) would see them change. The layer refuses keys that require grad.
"""
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

MIN_CAPACITY = 64  # columns a new buffer holds at least (one AR step must not reallocate every call)


def _holds(buffer_dtype, new_dtype) -> bool:
    """Whether a buffer of buffer_dtype takes new states as torch.cat would keep it (no promotion).
    Equal dtypes first: the common case costs one comparison per append."""
    return buffer_dtype == new_dtype or torch.promote_types(buffer_dtype, new_dtype) == buffer_dtype


class InPlaceLayer(CacheLayerMixin):
    """One attention layer's cache: buffers (b, heads, capacity, dim) and a used length."""

    is_croppable = True

    def __init__(self):
        super().__init__()
        self._key_buf = self._value_buf = None
        self.length = 0

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def _expose(self):
        self.keys = self._key_buf[:, :, :self.length]
        self.values = self._value_buf[:, :, :self.length]

    def _fits(self, key_states, value_states, needed):
        """Whether the buffers take the new columns as they are: room for them, and a dtype the
        new states need no promotion to (torch.cat would promote: a float32 step against a
        bfloat16-autocast prefill, as the forward-cost table runs, makes the cache float32)."""
        k, v = self._key_buf, self._value_buf
        return (k is not None and needed <= k.shape[-2]
                and _holds(k.dtype, key_states.dtype) and _holds(v.dtype, value_states.dtype))

    def _grow(self, needed, key_states, value_states):
        capacity = max(2 * needed, MIN_CAPACITY, 0 if self._key_buf is None else self._key_buf.shape[-2])
        bufs = []
        for new, old in ((key_states, self._key_buf), (value_states, self._value_buf)):
            b, heads, _, dim = new.shape
            dtype = new.dtype if old is None else torch.promote_types(old.dtype, new.dtype)
            # zeros, not empty: packed rows (write_rows) leave columns unwritten below another row's
            # length, and attention multiplies a masked column's value by a zero weight; a NaN that
            # uninitialised memory holds would still poison the row (it did, in bfloat16, at batch 8)
            buf = new.new_zeros((b, heads, capacity, dim), dtype=dtype)
            if old is not None and self.length:
                buf[:, :, :self.length] = old[:, :, :self.length]
            bufs.append(buf)
        self._key_buf, self._value_buf = bufs

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.requires_grad or value_states.requires_grad:
            raise RuntimeError("the in-place KV cache is for decoding under torch.no_grad(); "
                               "a later append would overwrite keys an autograd graph still holds")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.length, key_states.shape[-2]
        if self._key_buf is not None and (key_states.shape[:2] != self._key_buf.shape[:2]
                                          or key_states.shape[-1] != self._key_buf.shape[-1]):
            # an assignment would broadcast where torch.cat raises: refuse, naming both shapes
            raise ValueError(f"new keys of shape {tuple(key_states.shape)} do not match a cache of "
                             f"{tuple(self._key_buf.shape[:2])} rows x heads and head size {self._key_buf.shape[-1]}")
        if not self._fits(key_states, value_states, n + q):
            self._grow(n + q, key_states, value_states)
        self._key_buf[:, :, n:n + q] = key_states
        self._value_buf[:, :, n:n + q] = value_states
        self.length = n + q
        self._expose()
        return self.keys, self.values

    def write_rows(self, rows, cols, keys, values, kv_len, batch):
        """Packed columns into rows of their own (packed_rows.py): column i of keys / values
        (kv_heads, N, dim) goes to batch row rows[i] (of `batch`), cache column cols[i]; rows then
        hold caches of different lengths, which the caller tracks. Returns views of the first kv_len
        columns of every row. The layer's `length` becomes kv_len: what a later growth must copy."""
        if keys.requires_grad or values.requires_grad:
            raise RuntimeError("the in-place KV cache is for decoding under torch.no_grad()")
        if not self.is_initialized:  # no prefill (one-token prompts)
            self.lazy_initialization(keys, values)
        if not self._fits(keys, values, kv_len):
            self.length = 0 if self._key_buf is None else self._key_buf.shape[-2]  # every column may hold keys
            self._grow(kv_len, keys[None].expand(batch, -1, -1, -1), values[None].expand(batch, -1, -1, -1))
        # (an index put does not cast as a slice assignment does; the buffer's dtype holds the new one)
        self._key_buf[rows, :, cols] = keys.transpose(0, 1).to(self._key_buf.dtype)
        self._value_buf[rows, :, cols] = values.transpose(0, 1).to(self._value_buf.dtype)
        self.length = kv_len
        self._expose()
        return self.keys, self.values

    def get_seq_length(self):
        return self.length

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_max_length(self):
        return -1

    def crop(self, tokens_to_remove):
        """Drop the last -tokens_to_remove columns (a negative count, as transformers 5.x's crop)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self._key_buf is None:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._expose()

    def batch_select_indices(self, indices):
        """Keep batch rows `indices` (rows that finished stop costing compute)."""
        if self._key_buf is None:
            return
        idx = indices.to(self._key_buf.device)
        self._key_buf = self._key_buf.index_select(0, idx)
        self._value_buf = self._value_buf.index_select(0, idx)
        self._expose()

    def batch_repeat_interleave(self, repeats):
        if self._key_buf is None:
            return
        self._key_buf = self._key_buf.repeat_interleave(repeats, dim=0)
        self._value_buf = self._value_buf.repeat_interleave(repeats, dim=0)
        self._expose()

    def reorder_cache(self, beam_idx):
        self.batch_select_indices(beam_idx)

    def reset(self):
        self._key_buf = self._value_buf = self.keys = self.values = None
        self.length = 0
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("the in-place KV cache does not offload")

    def prefetch(self):
        raise NotImplementedError("the in-place KV cache does not offload")


def in_place_cache(num_layers: int) -> Cache:
    """An empty cache of `num_layers` in-place layers."""
    return Cache(layers=[InPlaceLayer() for _ in range(num_layers)])
