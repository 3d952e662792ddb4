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
        let code = crate::ffi::nccl::NCCL_HEADER_VERSION_CODE;
        Some((code, crate::ffi::nccl::version_string(code)))
    }
    #[cfg(not(feature = "nccl"))]
    None
}

/// The build facts as a JSON object with the keys `crate_version`, `features`, `backends`,
/// `cuda_archs`, `cudart`, `nccl_header_version`, `nccl_header_version_code`, `torch`, `profile`.
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
    let archs: Vec<&str> = env!("DEEP_EP_BUILD_CUDA_ARCHS").split(',').filter(|s| !s.is_empty()).collect();
    let (code, version) = match nccl_header() {
        Some((c, v)) => (c.to_string(), quote(&v)),
        None => ("null".into(), "null".into()),
    };
    let fields = [
        ("crate_version", quote(env!("CARGO_PKG_VERSION"))),
        ("features", list(&features)),
        ("backends", list(&backends)),
        ("cuda_archs", list(&archs)),
        ("cudart", quote(env!("DEEP_EP_BUILD_CUDART"))),
        ("nccl_header_version", version),
        ("nccl_header_version_code", code),
        ("torch", quote(env!("DEEP_EP_BUILD_TORCH"))),
        ("profile", quote(if cfg!(debug_assertions) { "debug" } else { "release" })),
    ];
    format!("{{{}}}", fields.iter().map(|(k, v)| format!("{}: {v}", quote(k))).collect::<Vec<_>>().join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_every_key_and_escapes_strings() {
        let j = json();
        for k in ["crate_version", "features", "backends", "cuda_archs", "cudart", "nccl_header_version", "torch", "profile"] {
            assert!(j.contains(&format!("\"{k}\": ")), "{k} missing from {j}");
        }
        assert!(j.starts_with('{') && j.ends_with('}'));
        assert!(j.contains("\"backends\": [\"cpu\""));
        assert_eq!(quote("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
