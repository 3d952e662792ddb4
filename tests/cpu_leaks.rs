//! Resource leaks of the CPU backend: 200 buffers created and destroyed by rank threads (half
//! through the handle registry, half as bare `CpuBackend`s), plus failed creations, leave no
//! extra open file descriptor (memfds and sockets included), no `deep_ep_` mapping, and no file
//! in `DEEP_EP_SHM_DIR` (named files) or `/dev/shm` (anonymous memory, the default).
//!
//! One test function only: the checks read process-wide state (`/proc/self`), which parallel
//! tests of the same binary would disturb.

use deep_ep::backend::cpu::CpuBackend;
use deep_ep::backend::{Backend, CreateArgs};
use deep_ep::tensor::Device;
use std::path::{Path, PathBuf};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn deep_ep_maps() -> Vec<String> {
    // The backend's files are named deep_ep_<id>; match the file name, not the path (a checkout or
    // a temporary folder may be called deep_ep_* too).
    // Anonymous memory shows as /memfd:deep_ep_<id>.
    let is_shm_file = |l: &&str| {
        let f = l.trim_end().trim_end_matches(" (deleted)").rsplit('/').next().unwrap_or("");
        f.trim_start_matches("memfd:").starts_with("deep_ep_")
    };
    std::fs::read_to_string("/proc/self/maps").unwrap_or_default().lines().filter(is_shm_file).map(str::to_string).collect()
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default()
}

fn args(id: &[u8], rank: usize, num_ranks: usize, nvl: usize) -> CreateArgs<'_> {
    CreateArgs { unique_id: id, rank, num_ranks, device: Device::Cpu, num_nvl_bytes: nvl, num_rdma_bytes: 1 << 16, low_latency_mode: true }
}

/// One buffer of `num_ranks` rank threads; `registry` picks the op-level path (handles).
fn cycle(num_ranks: usize, registry: bool) {
    let id = CpuBackend::unique_id();
    let threads: Vec<_> = (0..num_ranks)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || {
                if registry {
                    let a = args(&id, rank, num_ranks, 1 << 20);
                    let (r, n, nvl, rdma) = (a.rank as i64, a.num_ranks as i64, a.num_nvl_bytes as i64, a.num_rdma_bytes as i64);
                    let h = deep_ep::ops::create_buffer(&id, r, n, a.device, nvl, rdma, a.low_latency_mode, "cpu").expect("create_buffer");
                    assert_eq!(deep_ep::ops::buffer_info(h, "deep_ep::buffer_info").expect("buffer_info")[0], rank as i64);
                    deep_ep::ops::destroy_buffer(h).expect("destroy_buffer");
                    let e = deep_ep::ops::buffer_info(h, "deep_ep::buffer_info").expect_err("destroyed handle");
                    assert!(e.to_string().contains("was destroyed"), "{e}");
                } else {
                    let mut b = CpuBackend::create(&args(&id, rank, num_ranks, 1 << 20)).expect("create");
                    b.destroy().expect("destroy");
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().expect("rank thread"));
}

/// `shm_dir`: `Some` for named files in that folder, `None` for anonymous memory.
fn two_hundred_buffers(shm_dir: Option<&Path>) {
    match shm_dir {
        Some(dir) => std::env::set_var("DEEP_EP_SHM_DIR", dir),
        None => std::env::remove_var("DEEP_EP_SHM_DIR"),
    }
    let watched = shm_dir.map_or_else(|| PathBuf::from("/dev/shm"), Path::to_path_buf);
    let deep_ep_files = || files_in(&watched).into_iter().filter(|p| p.to_string_lossy().contains("/deep_ep_")).collect::<Vec<_>>();
    let files_before = deep_ep_files();
    // Creations that must succeed wait as long as a loaded machine may need (the default 100 s;
    // they return as soon as both ranks are there).
    std::env::remove_var("DEEP_EP_TIMEOUT_MS");
    cycle(2, true); // warm-up: thread-locals, the registry, lazily opened files
    let (fds, maps) = (open_fds(), deep_ep_maps());
    assert!(maps.is_empty(), "mappings before the loop: {maps:?}");

    let mut made = 0;
    for i in 0..50 {
        // two buffers of two ranks at once (four threads), alternating the two paths
        let a = std::thread::spawn(move || cycle(2, i % 2 == 0));
        let b = std::thread::spawn(move || cycle(2, i % 2 == 1));
        a.join().unwrap();
        b.join().unwrap();
        made += 4;
    }
    assert_eq!(made, 200);

    // failed creations: a missing peer (timeout), a missing rank 0 (timeout) and mismatched
    // sizes (error after the rendezvous, or a timeout if one thread comes late: a failure either way)
    std::env::set_var("DEEP_EP_TIMEOUT_MS", "200");
    let id = CpuBackend::unique_id();
    assert!(CpuBackend::create(&args(&id, 1, 2, 1 << 20)).is_err());
    let id = CpuBackend::unique_id();
    assert!(CpuBackend::create(&args(&id, 0, 2, 1 << 20)).is_err());
    let id = CpuBackend::unique_id();
    let id2 = id.clone();
    let t = std::thread::spawn(move || CpuBackend::create(&args(&id2, 1, 2, 1 << 21)).is_err());
    assert!(CpuBackend::create(&args(&id, 0, 2, 1 << 20)).is_err());
    assert!(t.join().unwrap());

    assert_eq!(deep_ep::buffer::live_count(), 0, "buffers still registered");
    assert_eq!(deep_ep_files(), files_before, "files left in {}", watched.display());
    assert_eq!(deep_ep_maps(), Vec::<String>::new(), "deep_ep_ mappings left");
    assert_eq!(open_fds(), fds, "open file descriptors grew");
}

#[test]
fn two_hundred_buffers_leave_nothing_behind() {
    let dir = std::env::temp_dir().join(format!("deep_ep_leak_test_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    two_hundred_buffers(Some(&dir));
    std::fs::remove_dir(&dir).unwrap();
    two_hundred_buffers(None);
}
