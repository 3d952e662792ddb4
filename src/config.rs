//! `Config` (DeepEP V1's kernel tuning knobs), the default tables per rank count, and the
//! buffer-size hints. The formulas are DeepEP V1's, so sizes computed for DeepEP work here.

use crate::error::{Error, Result};

/// Length of every unique id (defined with the declarations it must match, in `sys`).
pub use crate::sys::UNIQUE_ID_BYTES;

/// Normal-mode kernel configuration. Crosses the op boundary as `int[5]` in this field order.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Thread blocks used by normal-mode kernels; even; channels = `num_sms / 2`.
    pub num_sms: usize,
    /// Tokens a sender pushes before publishing its tail (NVLink ring).
    pub num_max_nvl_chunked_send_tokens: usize,
    /// Ring-buffer slots per (channel, peer) on NVLink.
    pub num_max_nvl_chunked_recv_tokens: usize,
    /// Same as the NVLink pair, for the RDMA ring (internode).
    pub num_max_rdma_chunked_send_tokens: usize,
    /// RDMA ring slots; rounded up to a multiple of the send chunk.
    pub num_max_rdma_chunked_recv_tokens: usize,
}

const OP: &str = "deep_ep::Config";

/// Bytes `NUM_BUFFER_ALIGNMENT_BYTES` in DeepEP.
pub const BUFFER_ALIGNMENT: usize = 128;
/// Largest `config.num_sms` (two per channel; the kernels' `DEK_IC_MAX_CHANNELS` is 512).
pub const MAX_NUM_SMS: usize = 1024;
/// Most NVLink peers in one domain.
pub const MAX_NVL_PEERS: usize = 8;

impl Config {
    /// Validates and normalises like DeepEP's `Config` constructor.
    pub fn new(num_sms: usize, nvl_send: usize, nvl_recv: usize, rdma_send: usize, rdma_recv: usize) -> Result<Self> {
        crate::ensure!(nvl_send > 0 && nvl_recv > 0, OP, "NVLink chunk sizes must be positive, got send={nvl_send} recv={nvl_recv}");
        crate::ensure!(
            nvl_send < nvl_recv,
            OP,
            "num_max_nvl_chunked_send_tokens ({nvl_send}) must be < num_max_nvl_chunked_recv_tokens ({nvl_recv})"
        );
        crate::ensure!(rdma_send > 0 && rdma_recv > 0, OP, "RDMA chunk sizes must be positive, got send={rdma_send} recv={rdma_recv}");
        let rdma_recv = rdma_recv.div_ceil(rdma_send) * rdma_send;
        crate::ensure!(
            rdma_send <= rdma_recv / 2,
            OP,
            "num_max_rdma_chunked_send_tokens ({rdma_send}) must be <= half of num_max_rdma_chunked_recv_tokens ({rdma_recv})"
        );
        Ok(Config {
            num_sms,
            num_max_nvl_chunked_send_tokens: nvl_send,
            num_max_nvl_chunked_recv_tokens: nvl_recv,
            num_max_rdma_chunked_send_tokens: rdma_send,
            num_max_rdma_chunked_recv_tokens: rdma_recv,
        })
    }

    /// Parses the `int[5]` op argument; `op` names the calling op in errors.
    pub fn from_slice(op: &'static str, v: &[i64]) -> Result<Self> {
        if v.len() != 5 || v.iter().any(|&x| x < 0) {
            return Err(Error::invalid(
                op,
                format!("config must be 5 non-negative ints [num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv], got {v:?}"),
            ));
        }
        let c = Config::new(v[0] as usize, v[1] as usize, v[2] as usize, v[3] as usize, v[4] as usize)
            .map_err(|e| Error::invalid(op, e.to_string()))?;
        crate::ensure!(c.num_sms >= 2 && c.num_sms % 2 == 0, op, "config.num_sms must be even and >= 2, got {}", c.num_sms);
        crate::ensure!(c.num_sms <= MAX_NUM_SMS, op, "config.num_sms must be at most {MAX_NUM_SMS} (2 per channel), got {}", c.num_sms);
        Ok(c)
    }

    /// Channels used by normal-mode kernels.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    /// DeepEP's `get_nvl_buffer_size_hint(hidden_bytes, num_ranks)` (NVSHMEM-less build:
    /// no SourceMeta term), generous in top-k (128) and scales (128) per token, for ranks in
    /// NVLink domains of `nvl_domain` (DeepEP's `NUM_MAX_NVL_PEERS`, 8 unless
    /// `DEEP_EP_NVL_DOMAIN_SIZE` says otherwise): the buffer holds one domain's peers.
    pub fn nvl_buffer_size_hint(&self, hidden_bytes: usize, num_ranks: usize, nvl_domain: usize) -> usize {
        let c = self.num_channels();
        let rn = num_ranks.min(nvl_domain);
        let rr = (num_ranks / nvl_domain).max(1);
        let t = self.num_max_nvl_chunked_recv_tokens;
        let bytes =
            c * rn * (2 * rr + 3) * 4 + c * rn * t * hidden_bytes + c * rn * t * 128 * 8 + c * rn * t * 128 * 4 + c * rn * t * 128 * 4;
        bytes.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
    }

    /// DeepEP's `get_rdma_buffer_size_hint` for ranks in NVLink domains of `nvl_domain`: 0 within
    /// one domain, else sized for the `num_ranks / nvl_domain` domains.
    pub fn rdma_buffer_size_hint(&self, hidden_bytes: usize, num_ranks: usize, nvl_domain: usize) -> usize {
        if num_ranks <= nvl_domain {
            return 0;
        }
        let c = self.num_channels();
        let rr = num_ranks / nvl_domain;
        let t = self.num_max_rdma_chunked_recv_tokens;
        let bytes = c * rr * (8 * 2 + 2) * 2 * 4
            + c * rr * t * hidden_bytes * 2
            + c * rr * t * 8 * 2
            + c * rr * t * 128 * 8 * 2
            + c * rr * t * 128 * 4 * 2
            + c * rr * t * 128 * 4 * 2
            + c * rr * t * 16 * 2;
        bytes.div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
    }

    /// Fields in the op-argument order.
    pub fn to_array(&self) -> [i64; 5] {
        [
            self.num_sms as i64,
            self.num_max_nvl_chunked_send_tokens as i64,
            self.num_max_nvl_chunked_recv_tokens as i64,
            self.num_max_rdma_chunked_send_tokens as i64,
            self.num_max_rdma_chunked_recv_tokens as i64,
        ]
    }
}

/// DeepEP V1's default configs by rank count: the ranks a row covers, then (nvl_send, nvl_recv,
/// rdma_send, rdma_recv) chunk sizes of dispatch and of combine.
#[rustfmt::skip]
const DEFAULT_CONFIGS: [(&[usize], [usize; 4], [usize; 4]); 9] = [
    (&[1, 2],           [24, 256, 6, 128], [10, 256, 6, 128]),
    (&[3, 4],           [6, 256, 6, 128],  [9, 256, 6, 128]),
    (&[5, 6, 7, 8],     [6, 256, 6, 128],  [4, 256, 6, 128]),
    (&[16],             [36, 288, 20, 128], [4, 288, 12, 128]),
    (&[24, 32, 48, 64], [32, 288, 8, 128], [1, 288, 8, 128]),
    (&[96],             [20, 480, 12, 128], [1, 480, 8, 128]),
    (&[128],            [20, 560, 12, 128], [1, 560, 8, 128]),
    (&[144],            [32, 720, 12, 128], [2, 720, 8, 128]),
    (&[160],            [28, 720, 12, 128], [2, 720, 8, 128]),
];

fn default_config(num_ranks: usize, num_sms: usize, combine: bool) -> Option<Config> {
    let (_, d, c) = DEFAULT_CONFIGS.iter().find(|(ranks, _, _)| ranks.contains(&num_ranks))?;
    let [a, b, e, f] = if combine { *c } else { *d };
    Config::new(num_sms, a, b, e, f).ok()
}

/// Default dispatch config for `num_ranks` (DeepEP V1's table) with `num_sms` blocks.
pub fn default_dispatch_config(num_ranks: usize, num_sms: usize) -> Option<Config> {
    default_config(num_ranks, num_sms, false)
}

/// Default combine config for `num_ranks` (DeepEP V1's table) with `num_sms` blocks.
pub fn default_combine_config(num_ranks: usize, num_sms: usize) -> Option<Config> {
    default_config(num_ranks, num_sms, true)
}

/// Sizes of the low-latency buffer regions (DeepEP V1's `LowLatencyLayout`), per half.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LowLatencyLayout {
    /// One dispatch message: 16-byte header + BF16 payload, or FP8 payload + f32 scales.
    pub dispatch_msg_bytes: usize,
    /// One combine slot: per-128 LogFMT meta + BF16 payload.
    pub combine_slot_bytes: usize,
    /// Send region per half.
    pub send_bytes: usize,
    /// Receive region per half.
    pub recv_bytes: usize,
    /// Signal region per half (aligned to 128).
    pub signal_bytes: usize,
}

impl LowLatencyLayout {
    /// Layout for `t` tokens per rank, `hidden` channels and `num_experts` experts.
    pub fn new(t: usize, hidden: usize, num_experts: usize) -> Self {
        let s = hidden / 128;
        let dispatch_msg_bytes = 16 + (hidden * 2).max(hidden + s * 4);
        let combine_slot_bytes = s * 4 + hidden * 2;
        let send_bytes = (t * dispatch_msg_bytes).max(num_experts * t * combine_slot_bytes);
        let recv_bytes = (num_experts * t * dispatch_msg_bytes).max(num_experts * t * combine_slot_bytes);
        let signal_bytes = (num_experts * 4).div_ceil(BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT;
        LowLatencyLayout { dispatch_msg_bytes, combine_slot_bytes, send_bytes, recv_bytes, signal_bytes }
    }

    /// Both halves of all three regions.
    pub fn total_bytes(&self) -> usize {
        2 * (self.signal_bytes + self.send_bytes + self.recv_bytes)
    }
}

/// DeepEP's `get_low_latency_rdma_size_hint`: independent of `num_ranks`, and rounded as
/// `((n + 128) / 128) * 128` (so an aligned size still grows by 128), for byte-compatibility.
pub fn low_latency_rdma_size_hint(t: usize, hidden: usize, _num_ranks: usize, num_experts: usize) -> usize {
    let n = LowLatencyLayout::new(t, hidden, num_experts).total_bytes();
    ((n + BUFFER_ALIGNMENT) / BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_match_deepep_worked_examples() {
        assert_eq!(low_latency_rdma_size_hint(128, 7168, 8, 288), 2_146_961_792);
        assert_eq!(low_latency_rdma_size_hint(128, 7168, 8, 256), 1_908_410_496);
        assert_eq!(low_latency_rdma_size_hint(16, 5120, 8, 256), 170_395_776);
        let l = LowLatencyLayout::new(128, 7168, 288);
        assert_eq!((l.dispatch_msg_bytes, l.combine_slot_bytes), (14_352, 14_560));
        // DeepEP's worked NVL hints include an 8-byte SourceMeta term only present with
        // NVSHMEM; ours omit it: 335,709,824 - 20/2*8*256*8.
        let c = Config::new(20, 6, 256, 6, 128).unwrap();
        assert_eq!(c.nvl_buffer_size_hint(7168 * 2, 8, MAX_NVL_PEERS), 335_709_824 - 10 * 8 * 256 * 8);
    }

    #[test]
    fn hints_size_for_the_nvlink_domain() {
        let c = Config::new(20, 6, 256, 6, 128).unwrap();
        // 4 ranks as 2 domains of 2: an RDMA area, and NVL room for the 2 peers of a domain.
        assert_eq!(c.rdma_buffer_size_hint(512, 4, 8), 0);
        assert!(c.rdma_buffer_size_hint(512, 4, 2) > 0);
        assert_eq!(c.rdma_buffer_size_hint(512, 4, 2), c.rdma_buffer_size_hint(512, 16, 8)); // 2 domains either way
        assert!(c.nvl_buffer_size_hint(512, 4, 2) < c.nvl_buffer_size_hint(512, 4, 8));
        let two_peers: usize = 10 * 2 * ((2 * 2 + 3) * 4 + 256 * (512 + 128 * 16)); // channels x peers x (heads + ring)
        assert_eq!(c.nvl_buffer_size_hint(512, 4, 2), two_peers.div_ceil(128) * 128);
    }

    #[test]
    fn config_checks_like_deepep() {
        assert!(Config::new(20, 256, 256, 6, 128).is_err());
        assert_eq!(Config::new(20, 6, 256, 6, 125).unwrap().num_max_rdma_chunked_recv_tokens, 126);
        assert!(Config::from_slice("op", &[21, 6, 256, 6, 128]).is_err());
        assert!(Config::from_slice("op", &[20, 6, 256]).is_err());
        assert_eq!(default_dispatch_config(4, 20).unwrap().num_max_nvl_chunked_send_tokens, 6);
        assert!(default_dispatch_config(5000, 20).is_none());
    }
}
