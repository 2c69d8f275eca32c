"""flash_attn.bert_padding's helpers, for code that pads and unpads around
flash_attn_varlen_func (`from orchard.bert_padding import unpad_input, pad_input`): plain
torch, differentiable, the flattened token order of FlashAttention-2's (batch-major)."""
import torch

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input",
           "unpad_input_for_concatenated_sequences", "pad_input"]


def index_first_axis(x, indices):
    """Rows `indices` of x (first_axis_dim, ...)."""
    return x[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A (first_axis_dim, ...) tensor of zeros with rows `indices` set to values."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of hidden_states (batch, seqlen, ...) where attention_mask (batch, seqlen;
    bool or 0/1) or unused_mask (allocated but unused tokens) is set. Returns (tokens
    (total, ...), their indices in the flattened batch (total,), cu_seqlens (batch + 1,)
    int32, the longest sequence (int), the tokens attention_mask sets per sequence (batch,)
    int32), as flash_attn 2.7+ does."""
    used = attention_mask.bool()
    taken = used if unused_mask is None else used | unused_mask.bool()
    seqlens = taken.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    # boolean indexing gathers from a strided view in place (no copy of the whole batch)
    return (hidden_states[taken], taken.flatten().nonzero().flatten(), cu_seqlens,
            int(seqlens.max()) if seqlens.numel() else 0, used.sum(-1, dtype=torch.int32))


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """The tokens of hidden_states (batch, seqlen, ...) whose rows each hold sequences end to
    end, their lengths in attention_mask_in_length (batch, seqlen): row b's lengths first,
    then zeros (for [[2, 3, 0, 0, 0], ...] row 0 holds a sequence of 2 tokens, then one of 3,
    then padding). Returns (tokens (total, ...), their indices in the flattened batch
    (total,), cu_seqlens (sequences + 1,) int32 over every row's sequences in order, the
    longest sequence (int)), as flash_attn's."""
    lengths = attention_mask_in_length
    totals = lengths.sum(-1)
    bad = ((lengths < 0).any(-1) | (totals > lengths.shape[1])).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError("unpad_input_for_concatenated_sequences: 'attention_mask_in_length' row "
                         "%d holds lengths %s: they must be at least 0 and fill at most its %d "
                         "positions" % (b, lengths[b].tolist(), lengths.shape[1]))
    taken = torch.arange(lengths.shape[1], device=lengths.device) < totals[:, None]
    seqlens = lengths.flatten()
    seqlens = seqlens[seqlens > 0].to(torch.int32)
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return (hidden_states[taken], taken.flatten().nonzero().flatten(), cu_seqlens,
            int(seqlens.max()) if seqlens.numel() else 0)


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total, ...) back at `indices` of a (batch, seqlen, ...) tensor of zeros:
    the inverse of unpad_input."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
