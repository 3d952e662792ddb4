//! What this build of the library contains, as one JSON object (`deep_ep::build_info`, used by
//! `python -m deep_ep_rs.diagnose`): crate version, cargo features, compiled backends, CUDA
//! targets, and the NCCL and torch versions it was built against.

/// Quotes `s` as a JSON string.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn list(items: &[&str]) -> String {
    format!("[{}]", items.iter().map(|s| quote(s)).collect::<Vec<_>>().join(", "))
}

/// `(NCCL_VERSION_CODE, "major.minor.patch")` of the headers the NCCL backend was built from.
fn nccl_header() -> Option<(i32, String)> {
    #[cfg(feature = "nccl")]
    {
        let code = crate::sys::nccl::NCCL_HEADER_VERSION_CODE;
        Some((code, crate::sys::nccl::version_string(code)))
    }
    #[cfg(not(feature = "nccl"))]
    None
}

/// `"major.minor"` of a CUDA version code (`1000 * major + 10 * minor`), JSON null when unknown.
fn cuda_version(code: i32) -> String {
    if code <= 0 {
        "null".into()
    } else {
        quote(&format!("{}.{}", code / 1000, code % 1000 / 10))
    }
}

/// `(cuda_runtime, cuda_driver)` as JSON values: the CUDA runtime linked in and the CUDA version
/// the installed driver supports (null without the cuda feature or without a driver).
fn cuda_versions() -> (String, String) {
    #[cfg(feature = "cuda")]
    {
        let (rt, drv) = crate::kernels::intranode::cuda_versions();
        (cuda_version(rt), cuda_version(drv))
    }
    #[cfg(not(feature = "cuda"))]
    ("null".into(), "null".into())
}

/// The build facts as a JSON object with the keys `crate_version`, `features`, `backends`,
/// `cuda_archs`, `cudart`, `cuda_runtime`, `cuda_driver`, `nccl_header_version`,
/// `nccl_header_version_code`, `torch`, `profile`, `nvshmem_device_transport` (true when the
/// NVSHMEM device transport, kernels/nvshmem/, is linked in) (`cuda_driver` is the one fact of the machine:
/// the CUDA version its driver supports).
pub fn json() -> String {
    let mut features = vec![];
    let mut backends = vec!["cpu"];
    if cfg!(feature = "cuda") {
        features.push("cuda");
    }
    if cfg!(feature = "nccl") {
        features.push("nccl");
        backends.push("nccl");
    }
    if cfg!(feature = "torch") {
        features.push("torch");
    }
    if cfg!(feature = "nvshmem") {
        features.push("nvshmem");
        backends.push("nvshmem");
    }
    if cfg!(feature = "ipc") {
        features.push("ipc");
        backends.push("ipc");
    }
    let archs: Vec<&str> = env!("DEEP_EP_BUILD_CUDA_ARCHS").split(',').filter(|s| !s.is_empty()).collect();
    let (code, version) = match nccl_header() {
        Some((c, v)) => (c.to_string(), quote(&v)),
        None => ("null".into(), "null".into()),
    };
    let (cuda_runtime, cuda_driver) = cuda_versions();
    let fields = [
        ("crate_version", quote(env!("CARGO_PKG_VERSION"))),
        ("features", list(&features)),
        ("backends", list(&backends)),
        ("cuda_archs", list(&archs)),
        ("cudart", quote(env!("DEEP_EP_BUILD_CUDART"))),
        ("cuda_runtime", cuda_runtime),
        ("cuda_driver", cuda_driver),
        ("nccl_header_version", version),
        ("nccl_header_version_code", code),
        ("torch", quote(env!("DEEP_EP_BUILD_TORCH"))),
        ("profile", quote(if cfg!(debug_assertions) { "debug" } else { "release" })),
        ("nvshmem_device_transport", cfg!(deep_ep_nvshmem_device).to_string()),
    ];
    format!("{{{}}}", fields.iter().map(|(k, v)| format!("{}: {v}", quote(k))).collect::<Vec<_>>().join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_every_key_and_escapes_strings() {
        let j = json();
        for k in [
            "crate_version",
            "features",
            "backends",
            "cuda_archs",
            "cudart",
            "cuda_runtime",
            "cuda_driver",
            "nccl_header_version",
            "torch",
            "profile",
            "nvshmem_device_transport",
        ] {
            assert!(j.contains(&format!("\"{k}\": ")), "{k} missing from {j}");
        }
        assert!(j.starts_with('{') && j.ends_with('}'));
        assert!(j.contains("\"backends\": [\"cpu\""));
        assert_eq!(quote("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        assert_eq!(cuda_version(13000), "\"13.0\"");
        assert_eq!(cuda_version(12080), "\"12.8\"");
        assert_eq!(cuda_version(0), "null");
    }
}
