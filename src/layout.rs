//! Layout math of normal-mode dispatch: token → rank/expert counts, channel ranges, and the
//! prefix matrices of the handle. Pure functions over host slices; the CPU backend, the
//! reference and the tests share them, and the GPU kernels must produce the same numbers.

/// Output of [`dispatch_layout`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// `[R]`: tokens with ≥ 1 expert on rank r (deduplicated per token).
    pub num_tokens_per_rank: Vec<i32>,
    /// `[R / D]` (internode only; empty when R ≤ D, D = ranks per NVLink domain): tokens with
    /// ≥ 1 expert on node g.
    pub num_tokens_per_rdma_rank: Vec<i32>,
    /// `[E]`: (token, k) selections of expert e.
    pub num_tokens_per_expert: Vec<i32>,
    /// `[N, R]`: token n selects ≥ 1 expert on rank r.
    pub is_token_in_rank: Vec<bool>,
}

/// DeepEP's `get_dispatch_layout`. `topk_idx` is `[num_tokens, topk]` of global expert ids;
/// entries outside `[0, num_experts)` (−1) are ignored. `num_experts % num_ranks == 0`.
pub fn dispatch_layout(topk_idx: &[i64], num_tokens: usize, topk: usize, num_experts: usize, num_ranks: usize) -> Layout {
    dispatch_layout_in_domains(topk_idx, num_tokens, topk, num_experts, num_ranks, crate::config::MAX_NVL_PEERS)
}

/// [`dispatch_layout`] with NVLink domains of `domain` ranks: `num_tokens_per_rdma_rank` has
/// `num_ranks / domain` entries when `num_ranks > domain`, none otherwise.
pub fn dispatch_layout_in_domains(
    topk_idx: &[i64],
    num_tokens: usize,
    topk: usize,
    num_experts: usize,
    num_ranks: usize,
    domain: usize,
) -> Layout {
    assert_eq!(topk_idx.len(), num_tokens * topk);
    let per_rank = num_experts / num_ranks;
    let num_nodes = if num_ranks > domain { num_ranks / domain } else { 0 };
    let mut l = Layout {
        num_tokens_per_rank: vec![0; num_ranks],
        num_tokens_per_rdma_rank: vec![0; num_nodes],
        num_tokens_per_expert: vec![0; num_experts],
        is_token_in_rank: vec![false; num_tokens * num_ranks],
    };
    let mut in_node = vec![false; num_nodes];
    for n in 0..num_tokens {
        in_node.iter_mut().for_each(|b| *b = false);
        for &e in &topk_idx[n * topk..(n + 1) * topk] {
            if e < 0 || e as usize >= num_experts {
                continue;
            }
            let e = e as usize;
            l.num_tokens_per_expert[e] += 1;
            let r = e / per_rank;
            let cell = &mut l.is_token_in_rank[n * num_ranks + r];
            if !*cell {
                *cell = true;
                l.num_tokens_per_rank[r] += 1;
            }
            if num_nodes > 0 {
                let g = r / domain;
                if !in_node[g] {
                    in_node[g] = true;
                    l.num_tokens_per_rdma_rank[g] += 1;
                }
            }
        }
    }
    l
}

/// Token range `[start, end)` of channel `c` when `num_tokens` are split into `num_channels`
/// contiguous chunks of `ceil(N / C)` (DeepEP's `get_channel_task_range`).
pub fn channel_range(num_tokens: usize, num_channels: usize, c: usize) -> (usize, usize) {
    let per = num_tokens.div_ceil(num_channels);
    let start = (per * c).min(num_tokens);
    let end = (start + per).min(num_tokens);
    (start, end)
}

/// `rank_prefix_matrix [R, R]`: `m[s][d] = Σ_{s' ≤ s} counts[s'][d]`, where `counts[s]` is
/// rank s's `num_tokens_per_rank`.
pub fn rank_prefix_matrix(counts: &[Vec<i32>]) -> Vec<i32> {
    let r = counts.len();
    let mut m = vec![0i32; r * r];
    for s in 0..r {
        for d in 0..r {
            m[s * r + d] = counts[s][d] + if s > 0 { m[(s - 1) * r + d] } else { 0 };
        }
    }
    m
}

/// Sender-side `channel_prefix_matrix [R, C]` (inclusive prefix over channels of the tokens
/// this rank sends to rank d) and `send_head [N, R]` (slot in the (channel, d) queue or −1),
/// from this rank's `is_token_in_rank [N, R]`.
pub fn send_side(is_token_in_rank: &[bool], num_tokens: usize, num_ranks: usize, num_channels: usize) -> (Vec<i32>, Vec<i32>) {
    let mut prefix = vec![0i32; num_ranks * num_channels];
    let mut send_head = vec![-1i32; num_tokens * num_ranks];
    for d in 0..num_ranks {
        let mut total = 0;
        for c in 0..num_channels {
            let (s, e) = channel_range(num_tokens, num_channels, c);
            let mut slot = 0;
            for n in s..e {
                if is_token_in_rank[n * num_ranks + d] {
                    send_head[n * num_ranks + d] = slot;
                    slot += 1;
                }
            }
            total += slot;
            prefix[d * num_channels + c] = total;
        }
    }
    (prefix, send_head)
}

/// Receiver-side row of `recv_channel_prefix_matrix` for one source: the start of each channel
/// inside the block received from that source (exclusive prefix), from the source's
/// `is_token_in_rank` column for this rank.
pub fn recv_channel_starts(src_in_rank: impl Fn(usize) -> bool, num_tokens: usize, num_channels: usize) -> Vec<i32> {
    let mut starts = vec![0i32; num_channels];
    let mut total = 0;
    for (c, start) in starts.iter_mut().enumerate() {
        *start = total;
        let (s, e) = channel_range(num_tokens, num_channels, c);
        total += (s..e).filter(|&n| src_in_rank(n)).count() as i32;
    }
    starts
}

/// Local expert id of global expert `e` on `rank`, or −1 if another rank hosts it.
pub fn to_local_expert(e: i64, rank: usize, num_local_experts: usize) -> i64 {
    let lo = (rank * num_local_experts) as i64;
    if e >= lo && e < lo + num_local_experts as i64 {
        e - lo
    } else {
        -1
    }
}

/// Expert ids of a CPU `topk_idx` (row-major, `k` per token) must lie in `[-1, num_experts)`;
/// anything else would be dropped or aliased silently. (On CUDA the ops' device-side checks or
/// the kernels' own bounds apply.)
pub fn check_expert_ids(op: &'static str, ids: &[i64], k: usize, num_experts: usize) -> crate::error::Result<()> {
    match ids.iter().position(|&v| v < -1 || v >= num_experts as i64) {
        None => Ok(()),
        Some(p) => Err(crate::error::Error::invalid(
            op,
            format!(
                "topk_idx[{}, {}] = {} is not an expert id: ids must be in [-1, {num_experts}) (-1 = no expert)",
                p / k.max(1),
                p % k.max(1),
                ids[p]
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_counts_and_masks() {
        // 3 tokens, top-2, 8 experts on 4 ranks.
        let idx = [0, 1, 7, -1, -1, -1];
        let l = dispatch_layout(&idx, 3, 2, 8, 4);
        assert_eq!(l.num_tokens_per_rank, vec![1, 0, 0, 1]);
        assert_eq!(l.num_tokens_per_expert, vec![1, 1, 0, 0, 0, 0, 0, 1]);
        assert_eq!(l.is_token_in_rank[0..4], [true, false, false, false]);
        assert!(l.num_tokens_per_rdma_rank.is_empty());
    }

    #[test]
    fn channels_cover_tokens_once() {
        for n in [0, 1, 5, 10, 11] {
            let mut covered = 0;
            for c in 0..4 {
                let (s, e) = channel_range(n, 4, c);
                assert!(s <= e);
                covered += e - s;
            }
            assert_eq!(covered, n);
        }
    }

    #[test]
    fn prefix_matrices() {
        let m = rank_prefix_matrix(&[vec![1, 2], vec![3, 4]]);
        assert_eq!(m, vec![1, 2, 4, 6]);
        let in_rank = [true, false, true, true, false, true];
        let (p, h) = send_side(&in_rank, 3, 2, 2);
        // channels: tokens {0,1} and {2}
        assert_eq!(p, vec![2, 2, 1, 2]);
        assert_eq!(h, vec![0, -1, 1, 0, -1, 0]);
        let starts = recv_channel_starts(|n| in_rank[n * 2 + 1], 3, 2);
        assert_eq!(starts, vec![0, 1]);
    }
}
