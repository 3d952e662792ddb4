//! Environment knobs, read in one place. Each is documented in README.md ("Environment").

use std::time::Duration;

/// Default deadline of every wait for peers.
pub const DEFAULT_TIMEOUT_MS: u64 = 100_000;

/// `DEEP_EP_TIMEOUT_MS`: how long any wait for a peer may take before it raises; read when a
/// buffer is created. Unset or empty: [`DEFAULT_TIMEOUT_MS`]. Anything but a whole number of
/// milliseconds >= 1 (`3000ms`, `abc`, `-1`, `0`) is an error naming the variable, not a silent default.
pub fn timeout(op: &'static str) -> crate::error::Result<Duration> {
    let v = match std::env::var("DEEP_EP_TIMEOUT_MS") {
        Ok(v) if !v.trim().is_empty() => v,
        _ => return Ok(Duration::from_millis(DEFAULT_TIMEOUT_MS)),
    };
    match v.trim().parse::<u64>() {
        Ok(ms) if ms >= 1 => Ok(Duration::from_millis(ms)),
        _ => Err(crate::error::Error::invalid(
            op,
            format!("DEEP_EP_TIMEOUT_MS={v:?} is not a whole number of milliseconds >= 1 (e.g. 30000); unset it for the default {DEFAULT_TIMEOUT_MS}"),
        )),
    }
}

/// `DEEP_EP_SHM_DIR`: a folder for named shared-memory files (CPU buffers, the ipc provider's
/// rendezvous), for ranks that cannot share anonymous memory (they do not share a network
/// namespace). Unset or empty (the default): anonymous memory, nothing in any folder.
pub fn shm_dir() -> Option<String> {
    std::env::var("DEEP_EP_SHM_DIR").ok().filter(|d| !d.is_empty())
}

/// [`shm_dir`], refused (naming op `op`) when it is set but not a folder.
pub fn shm_dir_checked(op: &'static str) -> crate::error::Result<Option<String>> {
    let Some(dir) = shm_dir() else { return Ok(None) };
    crate::ensure!(
        std::path::Path::new(&dir).is_dir(),
        op,
        "DEEP_EP_SHM_DIR={dir:?} is not a folder: set it to an existing writable folder shared by the ranks, or unset it \
         for anonymous memory (the default)"
    );
    Ok(Some(dir))
}

/// `DEEP_EP_INTRANODE_DISPATCH`: `pull` (default) or `push`, the data path of the nccl backend's
/// intranode (cached) dispatch; read once per process. All ranks must use the same (a mismatch
/// is reported as ranks running different ops). An unknown value keeps the default and says so.
pub fn intranode_dispatch_pull() -> bool {
    static PULL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PULL.get_or_init(|| two_way_knob("DEEP_EP_INTRANODE_DISPATCH", "pull", "push"))
}

/// `DEEP_EP_INTRANODE_COPY_WARPS`: warps of each 16-warp block of the push dispatch kernel that
/// copy received rows into the outputs while the others push (1..15, default 4); read once.
pub fn intranode_copy_warps() -> i32 {
    static W: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *W.get_or_init(|| range_knob("DEEP_EP_INTRANODE_COPY_WARPS", 1..=15, 4))
}

/// `DEEP_EP_CHECK_INPUTS`: `1` (default) or `0`. On the nccl backend, normal-mode ops run one
/// extra small kernel that checks the routing inputs' content on the device (expert ids in range,
/// layout tensors consistent with `topk_idx`, handles consistent with themselves), as the cpu
/// backend does on the host; `0` skips it (a few microseconds per op) and trusts the inputs. Read
/// once per process; all ranks should use the same.
pub fn check_inputs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| two_way_knob("DEEP_EP_CHECK_INPUTS", "1", "0"))
}

/// `DEEP_EP_INTRANODE_COMBINE`: `fused` (default: push and reduce overlapped in one kernel, per
/// channel flags instead of a data barrier) or `split` (push kernel, data barrier, reduce
/// kernel), the data path of the nccl backend's intranode combine; read once per process. Same
/// results; all ranks must use the same. An unknown value keeps the default and says so.
pub fn intranode_combine_fused() -> bool {
    static FUSED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FUSED.get_or_init(|| two_way_knob("DEEP_EP_INTRANODE_COMBINE", "fused", "split"))
}

/// `DEEP_EP_LL_LAUNCH`: `one` (default: a whole low-latency dispatch, no hook, runs its send and
/// receive in one kernel launch where its grid is resident at once: one rank on the GPU, no peer
/// behind the seam) or `two` (a send launch, then a receive launch, as with a hook); read once per
/// process. Same results; ranks may differ. With `one`, a hook-mode call at one rank on a GPU runs
/// the whole op ([`crate::backend::BufferInfo::ll_whole_hooks`]); with `two` its hook stays apart.
pub fn ll_one_launch() -> bool {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONE.get_or_init(|| two_way_knob("DEEP_EP_LL_LAUNCH", "one", "two"))
}

/// `DEEP_EP_LL_LOCAL`: `direct` (default: at one rank a one-launch low-latency dispatch writes its
/// outputs from the send, and a one-launch combine sums the expert outputs straight into `out`)
/// or `peer` (both go through the receive area as with peers); read once per process. Same results.
pub fn ll_local() -> bool {
    static DIRECT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DIRECT.get_or_init(|| two_way_knob("DEEP_EP_LL_LOCAL", "direct", "peer"))
}

/// `DEEP_EP_INTRANODE_REDUCE_WARPS`: warps of each 16-warp block of the fused combine kernel that
/// start reducing while the others push (1..15, default 4; push warps join the reduce when their
/// rows are out); read once.
pub fn intranode_reduce_warps() -> i32 {
    static W: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *W.get_or_init(|| range_knob("DEEP_EP_INTRANODE_REDUCE_WARPS", 1..=15, 4))
}

/// `var` read by `accept` (`default`, spelt `shown`, when unset); a value `accept` refuses keeps
/// the default and says so on stderr, naming the variable and what it takes (`expected`).
fn knob<T: Copy>(var: &str, (default, shown): (T, &str), expected: &str, accept: impl FnOnce(&str) -> Option<T>) -> T {
    let Ok(v) = std::env::var(var) else { return default };
    accept(v.trim()).unwrap_or_else(|| {
        eprintln!("[deep_ep] warn: {var}={v:?} is not {expected}; using {shown}");
        default
    })
}

/// `var` as a two-way switch: `on` (also when unset or empty) → true, `off` → false.
fn two_way_knob(var: &str, on: &str, off: &str) -> bool {
    knob(var, (true, on), &format!("{on} or {off}"), |v| match v {
        "" => Some(true),
        x if x == on => Some(true),
        x if x == off => Some(false),
        _ => None,
    })
}

/// `var` as an integer in `range` (`default` when unset).
fn range_knob(var: &str, range: std::ops::RangeInclusive<i32>, default: i32) -> i32 {
    let expected = format!("{}..{}", range.start(), range.end());
    knob(var, (default, &default.to_string()), &expected, |v| v.parse().ok().filter(|w| range.contains(w)))
}

/// One of `allowed` from `var` (default `allowed[0]`).
fn choice_knob(var: &str, allowed: &[i32]) -> i32 {
    choice_knob_or(var, allowed, allowed[0])
}

/// One of `allowed` from `var`, `default` when unset.
fn choice_knob_or(var: &str, allowed: &[i32], default: i32) -> i32 {
    knob(var, (default, &default.to_string()), &format!("one of {allowed:?}"), |v| v.parse().ok().filter(|u| allowed.contains(u)))
}

/// `DEEP_EP_INTRANODE_PUSH_UNROLL`: 16-byte loads in flight per lane of a push warp of the fused
/// combine, 8 (default) or 16 (twice the bytes in flight per warp); read once.
pub fn intranode_push_unroll() -> i32 {
    static U: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *U.get_or_init(|| choice_knob("DEEP_EP_INTRANODE_PUSH_UNROLL", &[8, 16]))
}

/// `DEEP_EP_INTRANODE_PULL_UNROLL`: 16-byte loads in flight per lane of a row copy of the pull
/// dispatch: 16 (the default with 512-thread blocks; measured: FP8 dispatch 513 -> 449 us against
/// 8, bench/NOTES.md), 8, or 4 (with 1024-thread blocks: the bytes in flight per SM of 512 x 8).
/// 1024-thread blocks do not offer 16 (64 registers: it spills) and take 8 instead, their default.
/// Unset = 0, the kernel's default for the block size; read once.
pub fn intranode_pull_unroll() -> i32 {
    static U: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *U.get_or_init(|| choice_knob_or("DEEP_EP_INTRANODE_PULL_UNROLL", &[16, 8, 4], 0))
}

/// `DEEP_EP_INTRANODE_PULL_THREADS`: threads per block of the pull dispatch kernel, 512 (default)
/// or 1024 (twice the warps per SM, 64 registers each); read once.
pub fn intranode_pull_threads() -> i32 {
    static T: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *T.get_or_init(|| choice_knob("DEEP_EP_INTRANODE_PULL_THREADS", &[512, 1024]))
}

/// `DEEP_EP_INTRANODE_COMBINE_THREADS`: threads per block of the split combine's push kernel
/// (`DEEP_EP_INTRANODE_COMBINE=split`), 512 (default) or 1024 (twice the warps storing over NVLink
/// per SM: measures whether the push rate follows the number of warps); read once.
pub fn intranode_combine_threads() -> i32 {
    static T: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *T.get_or_init(|| choice_knob("DEEP_EP_INTRANODE_COMBINE_THREADS", &[512, 1024]))
}
