//! Property tests of the normal-mode layout math (`deep_ep::layout`) against slow, obviously
//! correct recomputations: random shapes including 0 tokens, −1 and out-of-range ids, more
//! channels than tokens, and more than 8 ranks (per-node counts).

use deep_ep::layout::{channel_range, dispatch_layout, rank_prefix_matrix, recv_channel_starts, send_side};
use proptest::prelude::*;

/// (num_ranks, num_experts, num_tokens, topk, topk_idx) with ids in [-2, E] so that −1, other
/// negatives and `E` (out of range) all occur, at a density of roughly `masked` per mille.
fn routing() -> impl Strategy<Value = (usize, usize, usize, usize, Vec<i64>)> {
    (prop::sample::select(vec![1usize, 2, 3, 4, 5, 8, 16, 24]), 1usize..=6, 0usize..=48, 1usize..=9, 0u32..=1000).prop_flat_map(
        |(r, el, n, k, masked)| {
            let e = r * el;
            let id = prop_oneof![
                masked.max(1) => Just(-1i64),
                (1000 - masked).max(1) => 0..e as i64,
                20 => prop::sample::select(vec![-2i64, e as i64]),
            ];
            (Just(r), Just(e), Just(n), Just(k), prop::collection::vec(id, n * k))
        },
    )
}

fn valid(e: i64, num_experts: usize) -> bool {
    e >= 0 && (e as usize) < num_experts
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn dispatch_layout_counts_are_consistent((r, e, n, k, idx) in routing()) {
        let l = dispatch_layout(&idx, n, k, e, r);
        let per_rank = e / r;
        prop_assert_eq!(l.num_tokens_per_rank.len(), r);
        prop_assert_eq!(l.num_tokens_per_expert.len(), e);
        prop_assert_eq!(l.is_token_in_rank.len(), n * r);
        // is_token_in_rank: token n selects a valid expert of rank d (−1 and out-of-range ignored)
        for t in 0..n {
            for d in 0..r {
                let want = idx[t * k..(t + 1) * k].iter().any(|&x| valid(x, e) && x as usize / per_rank == d);
                prop_assert_eq!(l.is_token_in_rank[t * r + d], want, "token {} rank {}", t, d);
            }
        }
        // per-rank counts are the column sums of is_token_in_rank; their total is its popcount
        for d in 0..r {
            let col = (0..n).filter(|&t| l.is_token_in_rank[t * r + d]).count() as i32;
            prop_assert_eq!(l.num_tokens_per_rank[d], col);
            prop_assert!(col as usize <= n);
        }
        let total: i32 = l.num_tokens_per_rank.iter().sum();
        prop_assert_eq!(total as usize, l.is_token_in_rank.iter().filter(|&&b| b).count());
        // per-expert counts are selections (duplicates included)
        for x in 0..e {
            prop_assert_eq!(l.num_tokens_per_expert[x] as usize, idx.iter().filter(|&&v| v == x as i64).count());
        }
        let sel: i32 = l.num_tokens_per_expert.iter().sum();
        prop_assert_eq!(sel as usize, idx.iter().filter(|&&v| valid(v, e)).count());
        // per-node counts exist only beyond one NVLink domain
        if r > 8 {
            prop_assert_eq!(l.num_tokens_per_rdma_rank.len(), r / 8);
            for g in 0..r / 8 {
                let want = (0..n).filter(|&t| (g * 8..(g + 1) * 8).any(|d| l.is_token_in_rank[t * r + d])).count();
                prop_assert_eq!(l.num_tokens_per_rdma_rank[g] as usize, want);
            }
        } else {
            prop_assert!(l.num_tokens_per_rdma_rank.is_empty());
        }
    }

    #[test]
    fn channels_partition_tokens_in_order(n in 0usize..200, c in 1usize..80) {
        let mut at = 0;
        for ch in 0..c {
            let (s, e) = channel_range(n, c, ch);
            prop_assert_eq!(s, at, "channel {} starts where the previous ended", ch);
            prop_assert!(e >= s && e - s <= n.div_ceil(c));
            at = e;
        }
        prop_assert_eq!(at, n);
    }

    #[test]
    fn send_side_and_recv_starts_agree(
        (n, r, c, in_rank) in (0usize..64, 1usize..=8, 1usize..=80)
            .prop_flat_map(|(n, r, c)| (Just(n), Just(r), Just(c), prop::collection::vec(any::<bool>(), n * r)))
    ) {
        let (prefix, send_head) = send_side(&in_rank, n, r, c);
        prop_assert_eq!(prefix.len(), r * c);
        prop_assert_eq!(send_head.len(), n * r);
        for d in 0..r {
            let starts = recv_channel_starts(|t| in_rank[t * r + d], n, c);
            let mut before = 0i32;
            for ch in 0..c {
                let (s, e) = channel_range(n, c, ch);
                let in_ch: Vec<usize> = (s..e).filter(|&t| in_rank[t * r + d]).collect();
                // inclusive prefix over channels (sender) / exclusive start (receiver)
                prop_assert_eq!(prefix[d * c + ch], before + in_ch.len() as i32);
                prop_assert_eq!(starts[ch], before);
                // send_head: slot in the (channel, destination) queue, −1 when not sent
                for t in s..e {
                    let want = if in_rank[t * r + d] { in_ch.iter().position(|&u| u == t).unwrap() as i32 } else { -1 };
                    prop_assert_eq!(send_head[t * r + d], want, "token {} dest {}", t, d);
                }
                before += in_ch.len() as i32;
            }
            prop_assert_eq!(before as usize, (0..n).filter(|&t| in_rank[t * r + d]).count());
        }
    }

    #[test]
    fn rank_prefix_matrix_is_an_inclusive_column_prefix(
        counts in (1usize..=8).prop_flat_map(|r| prop::collection::vec(prop::collection::vec(0i32..1000, r), r))
    ) {
        let r = counts.len();
        let m = rank_prefix_matrix(&counts);
        prop_assert_eq!(m.len(), r * r);
        for d in 0..r {
            let mut acc = 0;
            for s in 0..r {
                acc += counts[s][d];
                prop_assert_eq!(m[s * r + d], acc);
            }
            // the last row is what each destination receives in total
            prop_assert_eq!(m[(r - 1) * r + d], counts.iter().map(|c| c[d]).sum::<i32>());
        }
    }
}

/// The layout of one rank feeds the handle math exactly as the CPU backend uses it: every
/// token routed to `d` gets a distinct slot, and slots of one channel are dense.
#[test]
fn zero_tokens_and_more_channels_than_tokens() {
    let l = dispatch_layout(&[], 0, 4, 16, 4);
    assert_eq!(l.num_tokens_per_rank, vec![0; 4]);
    assert_eq!(l.num_tokens_per_expert, vec![0; 16]);
    assert!(l.is_token_in_rank.is_empty());
    let (p, h) = send_side(&[], 0, 4, 12);
    assert_eq!(p, vec![0; 48]);
    assert!(h.is_empty());
    assert_eq!(recv_channel_starts(|_| true, 0, 12), vec![0; 12]);
    // 3 tokens, 10 channels: channels 0..3 hold one token each, the rest are empty
    let (p, _) = send_side(&[true, true, true], 3, 1, 10);
    assert_eq!(p, vec![1, 2, 3, 3, 3, 3, 3, 3, 3, 3]);
}
