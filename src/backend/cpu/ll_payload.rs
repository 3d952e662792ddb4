//! The payload formats of a CPU LL dispatch message: the format code its header carries (which
//! receivers check), and NVFP4's wire bytes and their placement into the outputs. BF16 and FP8
//! payloads are written and read in place by `ll.rs`.

use crate::backend::LlDispatchOptions;
use crate::numerics::nvfp4;
use crate::shm::Region;

/// The payload format of an LL dispatch, as carried in its messages: 0 = BF16, bit 0 = FP8
/// (bit 1 round_scale, bit 2 use_ue8m0), 8 = NVFP4 (named by
/// `backend::low_latency::dispatch_format_mismatch`).
pub(super) fn format_code(o: &LlDispatchOptions) -> i32 {
    if o.use_fp8 {
        1 | (o.round_scale as i32) << 1 | (o.use_ue8m0 as i32) << 2
    } else if o.use_nvfp4 {
        8
    } else {
        0
    }
}

/// Bytes of one NVFP4 token on the wire: H/2 packed values, then H/16 scales in hidden order.
pub(super) fn nvfp4_bytes(h: usize) -> usize {
    h / 2 + h / nvfp4::BLOCK
}

/// One token's NVFP4 wire bytes (`out`: [`nvfp4_bytes`] long).
pub(super) fn nvfp4_cast(row: &[u16], global_scale: f32, out: &mut [u8]) {
    let h = row.len();
    let (packed, scales) = out.split_at_mut(h / 2);
    nvfp4::cast_token(row, global_scale, packed, scales);
}

/// Copies the NVFP4 payload at `off` of `reg` into row `t` of local expert `l`: the packed values
/// into `recv_x` (`[E_l, rows, H/2]` bytes), the scales (through `sf`, H/16 bytes of scratch the
/// caller keeps across rows) into their swizzled places in `scales` (`[E_l, rm, rk, 512]` bytes, a
/// tile being `[32, 4, 4]`).
#[allow(clippy::too_many_arguments)]
pub(super) fn nvfp4_place(
    reg: &Region,
    off: usize,
    h: usize,
    l: usize,
    t: usize,
    rows: usize,
    recv_x: &mut [u8],
    scales: &mut [u8],
    sf: &mut [u8],
) {
    let half = h / 2;
    reg.read::<u8>(off, &mut recv_x[(l * rows + t) * half..(l * rows + t + 1) * half]);
    reg.read::<u8>(off + half, sf);
    let (rm, rk) = nvfp4::scale_tiles(rows, h);
    let base = l * rm * rk * 512;
    for (j, &v) in sf.iter().enumerate() {
        scales[base + nvfp4::scale_offset(t, j, rk)] = v;
    }
}
