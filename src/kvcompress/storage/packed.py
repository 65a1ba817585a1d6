"""Storage where every (row, KV head) of a layer holds its own number of tokens, packed.

Head-adaptive budgets give each KV head a different share of a layer's budget; a ``[batch,
kv_heads, slots, head_dim]`` tensor would have to be as long as the longest head, so the memory
saved by the short heads would be spent on padding. ``PackedSlots`` keeps one flat buffer of
slots instead: segment ``(row, head)`` lives at ``[start, start + length)`` with spare room after
it, so decoding appends each head's new token in place. Every segment gets the same spare room,
the room a uniform slot buffer of the segments' mean length gets: all segments grow by one token
per step, so they run out together and are repacked together, once per ~6% of growth, and the
spare bytes equal the uniform cache's at an equal total budget.

Attention gathers every segment, room included, into one ``[rows, heads, widest, d]`` block
(``index_select``; the index comes from each segment's start and capacity), with the validity of every slot as its
mask, and runs one exact call, the GQA group's query heads sharing their KV head's segment. Slots
past a segment's room point at a sentinel slot that is never valid. Tokens are valid from their
append (a decoding token sees itself) until ``mark_padding`` says otherwise; queries of a longer
step also get the step's causal mask over its own tokens. Between packings every shape is fixed
and the write positions are device tensors, so a decoding step is one capturable graph; the host
mirrors (``lengths``, ``room_left``) move on in ``advance``.

A layer swaps its dense slots for a packing once it has chosen each head's tokens (``slots.Slots``
is the interface both follow); attention then gets no slots from ``update`` (the packing attends itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from .attention import causal_slot_mask, dense_attention
from .codec import KVCodec, decoded_pair, encoded_pair, kv_from_spec, token_bytes
from .slots import Slots, SlotView, inner, nested, spare_slots
from .tensors import nbytes


def laid_out(
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]],
    valid: list[list[torch.Tensor | None]],
    lengths: list[list[int]],
    capacities: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """Segments ``parts[row][head]`` (keys and values, ``lengths`` rows each; ``valid``: their validity, None: all)
    laid out one after another in flat buffers, each in ``capacities`` slots, the last slot a sentinel (never valid):
    keys, values, validity and each segment's start."""
    first, first_values = parts[0][0]
    total = sum(map(sum, capacities))
    keys = first.new_zeros(total + 1, first.shape[-1])
    values = first_values.new_zeros(total + 1, first_values.shape[-1])  # (coded: rows of their own width)
    slot_valid = torch.zeros(total + 1, dtype=torch.bool, device=first.device)
    starts: list[list[int]] = []
    start = 0
    for r, row in enumerate(parts):
        starts.append([])
        for h, (segment_keys, segment_values) in enumerate(row):
            n = lengths[r][h]
            starts[r].append(start)
            keys[start : start + n] = segment_keys
            values[start : start + n] = segment_values
            held = valid[r][h]
            slot_valid[start : start + n] = True if held is None else held
            start += capacities[r][h]
    return keys, values, slot_valid, starts


# the packing's tensors as a file names them, and the attributes holding them
SAVED_TENSORS = dict(
    keys="keys", values="values", valid="valid", starts="starts_t", lengths="lengths_t", capacities="capacities_t"
)


class PackedSlots(Slots):
    """One layer's keys and values, a segment per (row, KV head), each with its own length."""

    NAME = "packed"

    def __init__(
        self,
        segments: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
        seen: int,
        codec: KVCodec | None = None,
    ) -> None:
        """``segments[row][head]``: that head's keys ``[n, d]``, values ``[n, d]`` and prompt
        positions ``[n]`` (ascending), as this storage holds them (``codec``: coded rows); ``seen``: the layer's
        tokens fed so far."""
        self.seen, self.codec = seen, codec
        self.rows, self.heads = len(segments), len(segments[0])
        self.lengths = [[int(k.shape[0]) for k, _, _ in row] for row in segments]  # host mirror of lengths_t
        self.positions = [[p for _, _, p in row] for row in segments]  # prompt positions held, per segment
        self._pack(
            [[(k, v) for k, v, _ in row] for row in segments],
            [[None] * self.heads for _ in range(self.rows)],
            spare_slots(self.mean_length()),
        )

    def mean_length(self) -> int:
        return sum(map(sum, self.lengths)) // (self.rows * self.heads)

    def _pack(
        self, parts: list[list[tuple[torch.Tensor, torch.Tensor]]], valid: list[list[torch.Tensor | None]], room: int
    ) -> None:
        """Lay the segments out afresh, each with ``room`` slots after it. The flat buffer's length
        and the widest segment differ by layer and request (they follow attention): a compiled step
        takes both as symbols (tensor sizes marked dynamic, never Python ints), so no request recompiles it."""
        capacities = [[n + room for n in row] for row in self.lengths]
        self.keys, self.values, self.valid, self.starts = laid_out(parts, valid, self.lengths, capacities)
        device = self.keys.device
        self.room_left = room  # the same for every segment: equal room, equal growth
        self.starts_t = torch.tensor([s for row in self.starts for s in row], device=device)  # [segments], row-major
        self.lengths_t = torch.tensor([n for row in self.lengths for n in row], device=device)
        self.capacities_t = torch.tensor([c for row in capacities for c in row], device=device)
        self.widest = max(map(max, capacities))
        self.restored(device)

    def restored(self, device: torch.device) -> None:
        """What the packing derives (also after loading it from a file): each slot's place in its
        segment, the sizes a compiled step takes as symbols, and the empty views ``update`` returns."""
        self.offsets = torch.arange(self.widest, device=device)
        for size in (self.keys, self.values, self.valid, self.offsets):
            torch._dynamo.maybe_mark_dynamic(size, 0)
        coded = self.codec
        dim, dtype = (self.keys.shape[-1], self.keys.dtype) if coded is None else (coded.dim, coded.dtype)
        self.none = torch.empty(self.rows, self.heads, 0, dim, dtype=dtype, device=device)  # no storage held twice

    @property
    def used(self) -> int:  # type: ignore[override]  # the longest segment: computed, never set
        return max(map(max, self.lengths))

    def reads_codes(self, new_keys: torch.Tensor) -> bool:
        return False  # a step attends segments rebuilt per head from decoded rows (attend)

    def view(self, decoded: bool = True) -> SlotView:
        return SlotView(self.none, self.none, None, None, None)

    def encode_with(self, codec: KVCodec) -> None:
        self.codec = codec
        self.keys, self.values = encoded_pair(codec, self.keys, self.values)
        self.restored(self.keys.device)

    def state_dict(self) -> dict[str, Any]:
        """The packing as a saved file holds it (docs/file-format.md): the layer's entries with no slots,
        then under ``packed.`` the flat buffers with their sentinel slot, each segment's start, length and
        capacity (row-major), its prompt positions."""
        positions = {f"positions.{r}.{h}": p for r, row in enumerate(self.positions) for h, p in enumerate(row)}
        packing: dict[str, Any] = {name: getattr(self, held) for name, held in SAVED_TENSORS.items()}
        packing.update(rows=self.rows, heads=self.heads, room_left=self.room_left, **positions)
        packing["codec"] = None if self.codec is None else self.codec.spec()
        no_slots = dict(keys=self.none, values=self.none, valid=None, positions=None, cursor=None)
        return {**no_slots, "seen_tokens": self.seen, "used": self.used, "codec": None, **nested(self.NAME, packing)}

    @classmethod
    def from_state(cls, layer_state: dict[str, Any], device: torch.device) -> PackedSlots:
        """The packing a layer's ``state_dict`` saved, for a layer that swaps to it as it loads."""
        packed = cls.__new__(cls)
        packed.load_state_dict(layer_state, device)
        return packed

    def load_state_dict(self, layer_state: dict[str, Any], device: torch.device) -> None:
        """The packing a layer's ``state_dict`` saved (tensors in host memory), on ``device``; host mirrors derived."""
        state = cast(dict[str, Any], inner(layer_state, self.NAME))  # a packing saves its own entries
        self.seen = layer_state["seen_tokens"]
        self.rows, self.heads, self.room_left = state["rows"], state["heads"], state["room_left"]
        self.codec = kv_from_spec(state.get("codec"))
        for name, held in SAVED_TENSORS.items():
            setattr(self, held, state[name].to(device))
        self.starts, self.lengths = (state[name].view(self.rows, self.heads).tolist() for name in ("starts", "lengths"))
        self.positions = [[state[f"positions.{r}.{h}"].to(device) for h in range(self.heads)] for r in range(self.rows)]
        self.widest = int(state["capacities"].max())
        self.restored(device)

    def segment(self, row: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``[n, d]`` and validity ``[n]`` of one segment (views, no copy)."""
        start, n = self.starts[row][head], self.lengths[row][head]
        return self.keys[start : start + n], self.values[start : start + n], self.valid[start : start + n]

    def make_room(self, new: int) -> None:
        """Repack (every segment with room for ``new`` more tokens plus spare) when the room runs out."""
        if new > self.room_left:
            self._repack(new + spare_slots(self.mean_length() + new))

    def reserve(self, tokens: int, buckets: bool = False) -> None:
        """Room for ``tokens`` more tokens in every segment (at least the usual spare room). No
        buckets are needed: a compiled step sees the packing's sizes as symbols (``_pack``)."""
        if tokens > self.room_left:
            self._repack(max(tokens, spare_slots(self.mean_length())))

    def _repack(self, room: int) -> None:
        kept = [[self.segment(r, h) for h in range(self.heads)] for r in range(self.rows)]
        self._pack(
            [[(k.clone(), v.clone()) for k, v, _ in row] for row in kept],
            [[m.clone() for _, _, m in row] for row in kept],
            room,
        )

    def newest(self, new: int) -> torch.Tensor:
        """Flat slots ``[segments * new]`` of this step's ``new`` tokens in every segment."""
        first = self.starts_t + self.lengths_t
        return first if new == 1 else (first[:, None] + torch.arange(new, device=first.device)).view(-1)

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values [rows, heads, q, d]`` to every segment (valid until ``mark_padding``)."""
        index = self.newest(keys.shape[2])
        keys, values = encoded_pair(self.codec, keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1]))
        self.keys.index_copy_(0, index, keys)
        self.values.index_copy_(0, index, values)
        self.valid.index_fill_(0, index, True)

    def close_step(self, new: int) -> None:
        """Every segment's length past this step's ``new`` tokens."""
        self.lengths_t.add_(new)

    def advance(self, new: int) -> None:
        """The host mirrors after ``new`` tokens were appended to every segment."""
        self.seen += new
        self.lengths = [[n + new for n in row] for row in self.lengths]
        self.room_left -= new

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Record which of this step's tokens are real: ``valid [rows, q]``."""
        index = self.newest(valid.shape[-1])
        self.valid.index_copy_(0, index, valid[:, None, :].expand(-1, self.heads, -1).reshape(-1))

    def visibility(
        self, new_block: torch.Tensor | None, q_len: int, new_valid: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Only the new tokens among themselves: ``attend`` knows the rest."""
        return new_block

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Exact attention of ``query [rows, q_heads, q, d]`` over each segment, whose newest ``q``
        slots are these queries' own tokens, seen as ``new_mask [rows, 1, q, q]`` says (None: causal;
        one query always sees its own token). ``keys``/``values``: the empty views, unused."""
        rows, q_heads, q_len, dim = query.shape
        index = self.gather_index()
        keys, values = (
            t.view(rows, self.heads, -1, dim)
            for t in decoded_pair(self.codec, self.keys.index_select(0, index), self.values.index_select(0, index))
        )
        seen = self.valid.index_select(0, index).view(rows, self.heads, 1, -1)
        if q_len > 1:  # the step's own tokens: each query sees those its mask allows
            step = causal_slot_mask(q_len, q_len, query.device) if new_mask is None else new_mask  # [rows | 1, 1, q, q]
            newest = (self.lengths_t.view(rows, self.heads, 1, 1) + torch.arange(q_len, device=query.device)).expand(
                -1, -1, q_len, -1
            )
            seen = seen.expand(-1, -1, q_len, -1).scatter(3, newest, step.expand(rows, self.heads, -1, -1))
        return dense_attention(query, keys, values, seen, scaling, softcap)

    def gather_index(self) -> torch.Tensor:
        """Flat slots ``[segments * widest]`` of every segment, room included; past a segment's room, the sentinel."""
        offsets = self.offsets
        return torch.where(
            offsets < self.capacities_t[:, None], self.starts_t[:, None] + offsets, self.valid.shape[0] - 1
        ).view(-1)

    def stored(self) -> None:
        return None  # segments of different lengths per head: no slots every head shares for a later prompt to attend

    def kept_positions(self, prefill_len: int) -> torch.Tensor:
        """``[rows, heads, n]`` prompt positions of each segment, ascending; shorter segments padded with -1 at the
        front."""
        width = max(len(p) for row in self.positions for p in row)
        out = torch.full((self.rows, self.heads, width), -1, dtype=torch.long, device=self.keys.device)
        for r in range(self.rows):
            for h in range(self.heads):
                held = self.positions[r][h]
                if len(held):
                    out[r, h, width - len(held) :] = held
        return out

    def memory(self, full_tokens: int) -> dict[str, int]:
        size, uncoded = token_bytes(self.codec, self.keys, self.values)
        used = sum(map(sum, self.lengths)) * size
        return {
            "kv_tokens": self.used,
            "kv_bytes_full": self.rows * self.heads * full_tokens * uncoded,
            "kv_bytes_kept": used,
            "spare_bytes": nbytes(self.keys, self.values) - used,  # the sentinel slot counts as spare
            "index_bytes": nbytes(
                self.valid, self.capacities_t, self.starts_t, self.lengths_t, *(p for r in self.positions for p in r)
            ),
            "bytes_read_per_step": 2 * self.rows * self.heads * self.widest * size,  # the gathered block and room
        }

    def joined(self, others: list[Slots]) -> PackedSlots:
        """These rows, then ``others``' (groups of one batch, not decoded yet), as one packing."""
        parts = [self, *cast(list[PackedSlots], others)]
        segments = [
            [(*part.segment(r, h)[:2], part.positions[r][h]) for h in range(part.heads)]
            for part in parts
            for r in range(part.rows)
        ]
        return PackedSlots(segments, self.seen, self.codec)

    def batch_apply(self, apply: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A batch operation (beam reorder, repeat) over the rows: applied to each row's segments."""
        rows = apply(torch.arange(self.rows)).tolist()
        parts = [[self.segment(r, h) for h in range(self.heads)] for r in rows]
        self.lengths = [list(self.lengths[r]) for r in rows]
        self.positions = [list(self.positions[r]) for r in rows]
        self.rows = len(rows)
        self._pack(
            [[(k.clone(), v.clone()) for k, v, _ in row] for row in parts],
            [[m.clone() for _, _, m in row] for row in parts],
            self.room_left,
        )
