//! Unit tests of `kernels::transport` (kept beside it so that the module stays under 800 lines).
use super::*;

fn args(status: *mut Status, claim: *mut i32) -> PingArgs {
    PingArgs {
        rank: 0,
        num_ranks: 4,
        rail_stride: 2,
        context: 0,
        signal: 0,
        seq: 1,
        bytes: 4096,
        src_off: 0,
        dst_off: 8192,
        expect: 1,
        timeout_ns: 1_000_000,
        status,
        claim,
    }
}

#[test]
fn struct_sizes_match_the_header() {
    check_struct_sizes("test").unwrap();
    assert_eq!(std::mem::size_of::<Status>(), 32);
    assert_eq!(std::mem::size_of::<GinReqs>(), 20);
}

/// The launchers validate before touching a device, so bad arguments are refused on any
/// machine (no GPU needed).
#[test]
fn self_test_launchers_refuse_bad_arguments() {
    let mut status = Status::default();
    let mut claim = 0i32;
    let lsa = LsaDesc {
        peer_base: [std::ptr::null_mut(); MAX_LSA_PEERS],
        rank: 0,
        num_ranks: 4,
        num_contexts: 1,
        num_signals: 8,
        signal_off: 0,
        window_bytes: 1 << 20,
    };
    let e = unsafe { ping_lsa("test", &lsa, &args(&mut status, &mut claim), std::ptr::null_mut()) }.unwrap_err().to_string();
    assert!(e.contains("LSA transport self-test") && e.contains("cudaErrorInvalidValue"), "{e}");
    // rail_stride must divide num_ranks
    let mut a = args(&mut status, &mut claim);
    a.rail_stride = 3;
    let e = unsafe { ping_gin("test", &[0u64; 64], 8 as *mut c_void, &a, std::ptr::null_mut()) }.unwrap_err().to_string();
    assert!(e.contains("GIN transport self-test"), "{e}");
    // A zeroed device comm has no GIN contexts.
    let e = unsafe { ping_gin("test", &[0u64; 128], 8 as *mut c_void, &args(&mut status, &mut claim), std::ptr::null_mut()) }
        .unwrap_err()
        .to_string();
    assert!(e.contains("cudaErrorInvalidValue"), "{e}");
}

/// The NVSHMEM launcher validates like the others (no GPU or NVSHMEM needed); a build without
/// the device transport says so instead.
#[test]
fn nvshmem_launcher_refuses_bad_arguments_or_names_the_missing_build() {
    let mut status = Status::default();
    let mut claim = 0i32;
    let net = |base: *mut c_void, num_signals| NvshmemDesc {
        base,
        rank: 0,
        num_ranks: 4,
        num_contexts: 2,
        num_signals,
        signal_off: 0,
        window_bytes: 1 << 20,
    };
    // Null window; then too few signals for a rail team of 2 starting at signal 7.
    let mut a = args(&mut status, &mut claim);
    let e = ping_nvshmem("test", &net(std::ptr::null_mut(), 8), &a, std::ptr::null_mut()).unwrap_err().to_string();
    a.signal = 7;
    let e2 = ping_nvshmem("test", &net(64 as *mut c_void, 8), &a, std::ptr::null_mut()).unwrap_err().to_string();
    let e3 = ping_nvshmem(
        "test",
        &net(64 as *mut c_void, 8),
        &PingArgs { rail_stride: 3, ..args(&mut status, &mut claim) },
        std::ptr::null_mut(),
    )
    .unwrap_err()
    .to_string();
    for e in [e, e2, e3] {
        if NVSHMEM_DEVICE_BUILT {
            assert!(e.contains("NVSHMEM transport self-test") && e.contains("cudaErrorInvalidValue"), "{e}");
        } else {
            assert!(e.contains("built without NVSHMEM's device library"), "{e}");
        }
    }
    // A null registration function is refused before any CUDA or NVSHMEM call.
    let e = unsafe { nvshmem_device_register("test", std::ptr::null_mut(), true) }.unwrap_err().to_string();
    let want = if NVSHMEM_DEVICE_BUILT {
        "nvshmemx_cumodule_init: finding this library's CUDA module"
    } else {
        "built without NVSHMEM's device library"
    };
    assert!(e.contains(want), "{e}");
    assert!(nvshmem_self_test_bytes(4) > lsa_self_test_bytes(4));
}

// What the fake `ncclDevCommCreate` below was handed: the requirement fields at their
// NCCL 2.28.9 offsets (`nccl_device/core.h`; the runtime version is pinned to the headers).
// Per thread: the stand-in is called on the test's own thread, and tests run in parallel.
thread_local! {
    static SEEN: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn seen() -> Vec<i32> {
    SEEN.with(|s| s.borrow().clone())
}

extern "C" fn fake_create(_comm: *mut c_void, reqs: *const u8, _out: *mut c_void) -> c_int {
    let int_at = |off: usize| unsafe { (reqs.add(off) as *const i32).read_unaligned() };
    let force = unsafe { *reqs.add(40) } as i32;
    SEEN.with(|s| *s.borrow_mut() = vec![int_at(24), force, int_at(44), int_at(48), int_at(52)]);
    0
}

#[test]
fn devcomm_create_passes_the_requirements_and_reports_no_gin() {
    let bad = GinReqs { gin_context_count: 5, ..Default::default() };
    let fake = fake_create as *mut c_void;
    // Refused before NCCL is called.
    assert_eq!(unsafe { gin_devcomm_create(fake, 8 as *mut c_void, &bad) }.unwrap_err(), -1);
    assert!(seen().is_empty());
    let r = GinReqs { gin_context_count: 4, gin_signal_count: 96, gin_counter_count: 2, lsa_barrier_count: 1, gin_force_enable: 1 };
    let (devcomm, info) = unsafe { gin_devcomm_create(fake, 8 as *mut c_void, &r) }.unwrap();
    assert_eq!(seen(), vec![1, 1, 4, 96, 2]);
    assert!(devcomm.len() * 8 >= unsafe { dek_nccl_devcomm_bytes() });
    // The fake granted nothing: the info says "no GIN", which the backend turns into its error.
    assert_eq!(info, GinInfo::default());
}

/// The whole host-side GIN setup without a NIC: the glue hands the plan's requirements to
/// (a stand-in for) ncclDevCommCreate, which grants no GIN as NCCL does on a machine without a
/// GPUDirect-RDMA NIC, and the backend turns that into its error.
#[cfg(feature = "nccl")]
#[test]
fn no_nic_gives_the_gin_unavailable_error() {
    use crate::backend::peer::gin::{granted, plan, GinKnobs, Workload};
    let k = GinKnobs::parse(|name| (name == "NCCL_GIN_TYPE").then(|| "3".to_string())).unwrap();
    let p = plan(Workload::LowLatency { num_local_experts: 2, num_ranks: 16 }, &k).unwrap();
    let r = unsafe { gin_devcomm_create(fake_create as *mut c_void, 8 as *mut c_void, &p.requirements()) };
    assert_eq!(seen(), vec![1, 1, 2, 128, 0]);
    let e = granted(&p, &k, 5, r, |c| format!("code {c}")).unwrap_err().to_string();
    assert!(e.contains("GIN setup on rank 5 failed: NCCL GPU-initiated networking is unavailable (NCCL_GIN_TYPE=3 asked for Gdaki): ncclDevCommCreate granted 0 GIN contexts (2 asked)"), "{e}");
}
