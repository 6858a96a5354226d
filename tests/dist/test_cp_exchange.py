"""The context-parallel head exchange (parallel/cp_comm.py: one all-to-all each way) against the chunk
built whole on every rank: SeqToHeads gives this rank's heads of every token in sequence order,
HeadsToSeq this rank's tokens of every head, and each one's backward is the other's exchange, for
uneven zig-zag pieces (T not a multiple of 2n, and T < 2n: empty pieces), float64 and bf16."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks


def _worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from longstraw_mcore.parallel.cp import CPLayout, local_positions
    from longstraw_mcore.parallel.cp_comm import HeadsToSeq, SeqToHeads

    L = CPLayout(group=dist.group.WORLD, rank=rank, size=world_size)
    worst = 0.0
    for dtype in (torch.float64, torch.bfloat16):
        for T in (2, 5, 23, 64):
            g = torch.Generator().manual_seed(T)
            H = 2 * world_size
            full = torch.randn(2, T, H, 3, generator=g).to(dtype)            # [B, T, H, D], the same on every rank
            up = torch.randn(2, T, H // world_size, 3, generator=g).to(dtype)  # a gradient w.r.t. the head shard
            mine = torch.tensor(local_positions(T, world_size, rank), dtype=torch.long)
            h0, h1 = rank * H // world_size, (rank + 1) * H // world_size
            x = full.index_select(1, mine).clone().requires_grad_(True)
            y = SeqToHeads.apply(x, L, T)
            assert y.shape == (2, T, h1 - h0, 3) and torch.equal(y, full[:, :, h0:h1]), (T, dtype)
            y.backward(up)
            # the upstream gradient of every rank's heads, at this rank's tokens
            ups = [torch.empty_like(up) for _ in range(world_size)]
            dist.all_gather(ups, up.contiguous())
            assert torch.equal(x.grad, torch.cat(ups, 2).index_select(1, mine)), (T, dtype)

            z = full[:, :, h0:h1].clone().requires_grad_(True)
            back = HeadsToSeq.apply(z, L, T)
            assert torch.equal(back, full.index_select(1, mine)), (T, dtype)
            gl = torch.randn(2, len(mine), H, 3, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
            back.backward(gl)
            gls = [None] * world_size
            dist.all_gather_object(gls, (mine, gl))
            want = torch.zeros(2, T, H, 3, dtype=dtype)
            for pos, grad in gls:
                want[:, pos] = grad
            assert torch.equal(z.grad, want[:, :, h0:h1]), (T, dtype)
            worst = max(worst, float((z.grad - want[:, :, h0:h1]).abs().max()))
    return worst


def test_head_exchange_is_an_all_to_all_that_equals_the_whole_chunk():
    for n in (2, 3):
        assert run_ranks(_worker, n) == [0.0] * n
