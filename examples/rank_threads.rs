//! The crate's Rust API without torch: two ranks as threads share one CPU (shared-memory) buffer.
//! Rank 0 makes the unique id; both ranks create the buffer collectively, compute DeepEP's
//! dispatch layout, dispatch their tokens (`deep_ep::host`, owned CPU tensors), send them back
//! unchanged through combine, check both against the expected result, and destroy the buffer.
//!
//! `cargo run --release --example rank_threads` (CPU backend; no GPU needed).
use deep_ep::config::{default_combine_config, default_dispatch_config, low_latency_rdma_size_hint};
use deep_ep::host::{self, HostTensor};
use deep_ep::layout::dispatch_layout;
use deep_ep::tensor::{DType, Device};

const RANKS: usize = 2;
const TOKENS: usize = 16;
const TOPK: usize = 2;
const EXPERTS: usize = 8;
const HIDDEN: usize = 1024;

/// Rank `rank`'s routing: token t picks experts (t + rank) % E and (t + rank + E/2) % E.
fn routing(rank: usize) -> Vec<i64> {
    (0..TOKENS).flat_map(|t| [((t + rank) % EXPERTS) as i64, ((t + rank + EXPERTS / 2) % EXPERTS) as i64]).collect()
}

/// Rank `rank`'s tokens: small integers, exact in bf16 (and their sums over 2 ranks too).
fn x_values(rank: usize) -> Vec<f64> {
    (0..TOKENS * HIDDEN).map(|i| ((i / HIDDEN * 7 + i % HIDDEN + rank * 31) % 17) as f64 - 8.0).collect()
}

fn run_rank(rank: usize, id: Vec<u8>) -> deep_ep::Result<String> {
    let dispatch_cfg = default_dispatch_config(RANKS, 20).expect("config for 2 ranks");
    let combine_cfg = default_combine_config(RANKS, 20).expect("config for 2 ranks");
    let d = deep_ep::ops::nvl_domain_size()?; // DEEP_EP_NVL_DOMAIN_SIZE, default 8
    let nvl = dispatch_cfg.nvl_buffer_size_hint(HIDDEN * 2, RANKS, d).max(combine_cfg.nvl_buffer_size_hint(HIDDEN * 2, RANKS, d));
    let rdma = low_latency_rdma_size_hint(TOKENS, HIDDEN, RANKS, EXPERTS).div_ceil(128) * 128;
    // Collective: waits for the other rank.
    let handle = deep_ep::ops::create_buffer(&id, rank as i64, RANKS as i64, Device::Cpu, nvl as i64, rdma as i64, true, "cpu")?;
    let info = deep_ep::ops::buffer_info(handle, "example")?;
    assert_eq!((info[0], info[1]), (rank as i64, RANKS as i64));

    let layout = dispatch_layout(&routing(rank), TOKENS, TOPK, EXPERTS, RANKS);
    // Each token's two experts are E/2 apart, i.e. on different ranks: every token goes to both.
    assert_eq!(layout.num_tokens_per_rank, vec![TOKENS as i32; RANKS]);
    assert_eq!(layout.num_tokens_per_expert.iter().sum::<i32>(), (TOKENS * TOPK) as i32);
    assert!(layout.is_token_in_rank.iter().all(|&b| b));

    // The same layout through the op, then dispatch and combine of real data.
    let topk = HostTensor::from_f64(DType::Int64, &[TOKENS, TOPK], &routing(rank).iter().map(|&e| e as f64).collect::<Vec<_>>());
    let weights = HostTensor::from_f64(DType::Float32, &[TOKENS, TOPK], &vec![0.5; TOKENS * TOPK]);
    let x = HostTensor::from_f64(DType::BFloat16, &[TOKENS, HIDDEN], &x_values(rank));
    let op_layout = host::get_dispatch_layout(&topk, EXPERTS, RANKS)?;
    assert_eq!(op_layout.num_tokens_per_rank.to_f64(), vec![TOKENS as f64; RANKS]);
    let d = host::dispatch(handle, &x, &topk, &weights, &op_layout, dispatch_cfg)?;
    // Every token reaches both ranks: rows are rank 0's tokens, then rank 1's, in token order.
    let want_x: Vec<f64> = (0..RANKS).flat_map(x_values).collect();
    assert_eq!(d.recv_x.to_f64(), want_x, "rank {rank}: recv_x");
    let want_src: Vec<f64> = (0..RANKS).flat_map(|_| (0..TOKENS).map(|t| t as f64)).collect();
    assert_eq!(d.handle.recv_src_idx.to_f64(), want_src, "rank {rank}: recv_src_idx");
    let combined = host::combine(handle, &d.recv_x, &d.handle, combine_cfg)?; // identity experts
    let want: Vec<f64> = x_values(rank).iter().map(|v| v * RANKS as f64).collect();
    assert_eq!(combined.to_f64(), want, "rank {rank}: combined = x summed over its {RANKS} ranks");
    deep_ep::ops::destroy_buffer(handle)?; // collective
    Ok(format!(
        "rank {rank}: buffer {handle} ({nvl} NVL + {rdma} RDMA bytes), tokens per rank {:?}, per expert {:?}, \
                 received {} rows, dispatch + combine checked",
        layout.num_tokens_per_rank,
        layout.num_tokens_per_expert,
        d.recv_x.sizes()[0]
    ))
}

fn main() -> deep_ep::Result<()> {
    let id = deep_ep::ops::get_unique_id("cpu", Device::Cpu)?;
    let ranks: Vec<_> = (0..RANKS)
        .map(|r| {
            let id = id.clone();
            std::thread::spawn(move || run_rank(r, id))
        })
        .collect();
    for r in ranks {
        println!("{}", r.join().expect("rank thread panicked")?);
    }
    println!("rank_threads: ok");
    Ok(())
}
