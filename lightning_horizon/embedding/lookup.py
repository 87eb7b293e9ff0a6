"""A lookup of a table whose rows are spread over the ranks: ids out to their rows' owners, partial sums back.

1. every id goes to the rank that owns its row (the ids and their bag numbers, swapped with every peer);
2. each owner sums the rows it owns per bag (a partial pooled vector per bag of each peer's batch);
3. the partial sums go back to the batch's rank, which adds them up.

The swaps of the partial sums (and of ``per_sample_weights``) run through autograd, so backward goes the same way
in reverse: a bag's gradient goes to every owner, which accumulates it into its own rows as a sparse gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_horizon.embedding import exchange

if TYPE_CHECKING:
    from lightning_horizon.embedding.bag import ShardedEmbeddingBag


def bags_of(input: Tensor, offsets: Optional[Tensor]) -> tuple[Tensor, Tensor, int]:
    """The ids (1-D), each id's bag number and the number of bags, from ``nn.EmbeddingBag``'s two input forms."""
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("ShardedEmbeddingBag: offsets must be None with 2-D input (one bag per row)")
        bags, size = input.shape
        return input.reshape(-1), torch.arange(bags).repeat_interleave(size), bags
    if input.dim() != 1 or offsets is None or offsets.dim() != 1:
        raise ValueError("ShardedEmbeddingBag: input is 2-D (bags x ids), or 1-D with 1-D offsets (each bag's start)")
    bags = offsets.numel()
    sizes = torch.diff(offsets, append=torch.tensor([input.numel()], dtype=offsets.dtype))
    return input, torch.arange(bags).repeat_interleave(sizes), bags


def pool(weight: Tensor, ids: Tensor, bag: Tensor, bags: int, weights: Optional[Tensor]) -> Tensor:
    """Per bag, the sum of the rows ``ids`` (times ``weights``); the gradient reaches ``weight`` as a sparse one."""
    rows = F.embedding(ids, weight, sparse=True)
    if weights is not None:
        rows = rows * weights.unsqueeze(1)
    return rows.new_zeros((bags, weight.shape[1])).index_add(0, bag, rows)


def lookup_sharded(table: ShardedEmbeddingBag, ids: Tensor, bag: Tensor, bags: int, weights: Optional[Tensor],
                   slots: Callable[[Tensor], Tensor]) -> Tensor:
    """Per bag of this rank's batch, the sum of the rows ``ids`` (times ``weights``) of a table placed over
    ``table.world`` ranks, each part summed by the rank that owns its rows; ``slots``: where the owner's rows are in
    its ``weight``. The bytes sent are counted in ``table.sent_bytes``."""
    world, group, rank, meter = table.world, table.group, table.rank, table.meter
    starts = torch.tensor([lo for lo, _ in table.bounds])
    owner = torch.searchsorted(starts, ids, right=True) - 1  # the last rank whose rows start at or before
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=world)
    # what each peer sends here: its ids' count and its batch's bags
    counts = torch.stack([send, torch.full_like(send, bags)], dim=1)
    got = exchange.swap_counts(counts, group, rank, meter)
    send_n, recv_n, peer_bags = send.tolist(), got[:, 0].tolist(), got[:, 1].tolist()
    columns = [(ids - starts[owner])[order], bag[order]]
    routed = [exchange.swap_blocks(c, send_n, recv_n, group, rank, meter) for c in columns]
    if weights is not None:
        # through autograd: weights that come from parameters get their gradient back from the owners
        columns.append(weights[order].to(table.weight.dtype))
        routed.append(exchange.SwapBlocks.apply(columns[-1], send_n, recv_n, group, rank, meter))
    others = [p for p in range(world) if p != rank]
    row = table.embedding_dim * table.weight.element_size()
    grads = torch.is_grad_enabled()
    sums = sum(peer_bags[p] for p in others) * row + (len(others) * bags * row if grads else 0)
    weight_grads = (sum(recv_n[p] for p in others) * columns[-1].element_size()
                    if weights is not None and grads and columns[-1].requires_grad else 0)
    table.sent_bytes += (counts[others].numel() * 8 + sum(send_n[p] for p in others)
                         * sum(c.element_size() for c in columns) + sums + weight_grads)
    # the bags of peer p's batch are numbered after those of peers 0..p-1 here
    base = torch.repeat_interleave(torch.tensor([0] + peer_bags[:-1]).cumsum(0), torch.tensor(recv_n))
    partial = pool(table.weight, slots(routed[0]), routed[1] + base, sum(peer_bags),
                   routed[2] if weights is not None else None)
    back = exchange.SwapBlocks.apply(partial, peer_bags, [bags] * world, group, rank, meter)
    return back.view(world, bags, -1).sum(0)


__all__ = ["bags_of", "lookup_sharded", "pool"]
