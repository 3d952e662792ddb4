//! Build script of `deep_ep`: nvcc kernels (feature `cuda`), NCCL bindings (feature `nccl`) and
//! the libtorch operator shim (feature `torch`). With `--no-default-features` it does nothing.
//!
//! Every environment knob is read through [`knob`] (so Cargo reruns when it changes) and listed in
//! [`KNOBS`]; when something required is missing the build stops with one message that lists
//! every knob and every place searched. Recipe and pitfalls: `docs/TOOLCHAIN.md` of the project.
//!
//! Link decisions (why the final `.so` has no NEEDED libcudart / libnccl):
//! - cudart is linked statically by default (`DEEP_EP_CUDART=static`); it coexists with torch's
//!   shared libcudart (same driver context, `cudaStream_t` is a `CUstream`).
//! - NCCL is never linked: `src/ffi/nccl.rs` dlopens `libnccl.so.2` (the one torch loaded).
//! - libtorch is linked only into the cdylib (`rustc-cdylib-link-arg`), never into test binaries,
//!   and the shim's static archive goes in whole (else its static registrars are dropped).
//! - The shim uses libtorch's stable ABI only (target 2.10) and links libtorch_cpu alone, so one
//!   build loads into every torch >= 2.10, CUDA or CPU-only (`make compat` checks it).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every knob this script reads: (name, meaning). Printed in full on failure.
const KNOBS: &[(&str, &str)] = &[
    ("DEEP_EP_PYTHON", "python used to locate torch and the pip CUDA/NCCL wheels (default: $VIRTUAL_ENV/bin/python, else the checkout's .venv/bin/python, else python3 on PATH)"),
    ("VIRTUAL_ENV", "active virtualenv; its bin/python is the default python"),
    ("LIBTORCH", "libtorch dir with include/ and lib/ for feature `torch` (overrides the python's torch; C++11 ABI assumed)"),
    ("CUDA_HOME", "CUDA toolkit with bin/nvcc, include/, lib/ or lib64/ (default: <site-packages>/nvidia/cu13)"),
    ("NCCL_HOME", "NCCL with include/nccl.h (default: <site-packages>/nvidia/nccl)"),
    ("DEEP_EP_CUDA_ARCHS", "comma list of SM targets compiled to SASS, e.g. 90 | 90,100 | 90a (default: 90)"),
    ("DEEP_EP_CUDART", "how cudart is linked: static (default) | shared"),
    ("NVSHMEM_HOME", "NVSHMEM with include/nvshmem.h and lib/libnvshmem_device.a for feature `nvshmem`'s device transport (default: <site-packages>/nvidia/nvshmem; absent: built without it)"),
    ("LIBCLANG_PATH", "directory of libclang.so for bindgen, features `cuda`/`nccl` (default: <site-packages>/clang/native of the PyPI `libclang` wheel)"),
    ("DEEP_EP_CLANG_BUILTINS", "C builtin headers (stddef.h, ...) given to bindgen's clang with -idirafter (default: `$CC -print-file-name=include`, CC defaulting to gcc)"),
];

/// Reads a knob (trimmed, empty = unset) and tells Cargo to rerun when it changes.
fn knob(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

fn feature(name: &str) -> bool {
    env::var_os(format!("CARGO_FEATURE_{}", name.to_uppercase().replace('-', "_"))).is_some()
}

/// The python interpreter and what it answered, queried at most once each.
struct Python {
    exe: String,
    chosen_by: &'static str,
    site_dirs: Option<Result<Vec<PathBuf>, String>>,
}

/// libtorch as the compiler and linker need it.
struct Torch {
    source: String,
    cxx11_abi: bool,
    include: Vec<PathBuf>,
    lib_dir: PathBuf,
}

impl Python {
    fn new(deep_ep_python: Option<String>, virtual_env: Option<String>, checkout_venv: &Path) -> Self {
        match (deep_ep_python, virtual_env) {
            (Some(p), _) => Python { exe: p, chosen_by: "DEEP_EP_PYTHON", site_dirs: None },
            (None, Some(v)) if Path::new(&v).join("bin/python").exists() => {
                Python { exe: format!("{v}/bin/python"), chosen_by: "VIRTUAL_ENV", site_dirs: None }
            }
            // The venv `make` creates, so that a plain `cargo build` / `cargo test` after it works.
            _ if checkout_venv.join("bin/python").exists() => {
                Python { exe: checkout_venv.join("bin/python").display().to_string(), chosen_by: "the checkout's .venv", site_dirs: None }
            }
            _ => Python { exe: "python3".into(), chosen_by: "default", site_dirs: None },
        }
    }

    fn run(&self, script: &str) -> Result<String, String> {
        let out = Command::new(&self.exe).args(["-c", script]).output().map_err(|e| format!("could not run `{}`: {e}", self.exe))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
            return Err(format!("`{} -c ...` failed: {last}", self.exe));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// site-packages directories (and the rest of sys.path) of this python.
    fn site_dirs(&mut self) -> Result<Vec<PathBuf>, String> {
        if self.site_dirs.is_none() {
            const SCRIPT: &str = "import os, site, sys, sysconfig\n\
                p = sysconfig.get_paths()\n\
                ds = [p['purelib'], p['platlib']] + list(getattr(site, 'getsitepackages', lambda: [])()) + [site.getusersitepackages()] + sys.path\n\
                seen = []\n\
                [seen.append(d) for d in ds if d and os.path.isdir(d) and d not in seen]\n\
                print('\\n'.join(seen))";
            let r = self.run(SCRIPT).map(|s| s.lines().map(PathBuf::from).collect());
            self.site_dirs = Some(r);
        }
        self.site_dirs.clone().unwrap_or_else(|| Err("unreachable".into()))
    }

    /// Finds `rel` under one of the site directories.
    fn find_in_site(&mut self, rel: &str) -> Result<PathBuf, String> {
        let dirs = self.site_dirs()?;
        dirs.iter().map(|d| d.join(rel)).find(|p| p.exists()).ok_or_else(|| {
            let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            format!("no {rel} under the site-packages of `{}` ({})", self.exe, list.join(", "))
        })
    }

    fn describe(&self) -> String {
        format!("`{}` (chosen by {})", self.exe, self.chosen_by)
    }

    fn torch(&self) -> Result<Torch, String> {
        const SCRIPT: &str = "import torch, torch.utils.cpp_extension as c\n\
            print('abi=%d' % int(torch._C._GLIBCXX_USE_CXX11_ABI))\n\
            print('version=' + torch.__version__)\n\
            [print('include=' + p) for p in c.include_paths()]\n\
            [print('lib=' + p) for p in c.library_paths()]";
        let out = self.run(SCRIPT)?;
        let (mut abi, mut version, mut include, mut libs) = (None, String::new(), vec![], vec![]);
        for line in out.lines() {
            match line.split_once('=') {
                Some(("abi", v)) => abi = Some(v == "1"),
                Some(("version", v)) => version = v.to_string(),
                Some(("include", v)) => include.push(PathBuf::from(v)),
                Some(("lib", v)) => libs.push(PathBuf::from(v)),
                _ => {}
            }
        }
        let lib_dir = libs.into_iter().find(|d| d.join("libc10.so").exists());
        match (abi, lib_dir) {
            (Some(cxx11_abi), Some(lib_dir)) if !include.is_empty() => {
                Ok(Torch { source: format!("torch {version} of `{}`", self.exe), cxx11_abi, include, lib_dir })
            }
            _ => Err(format!("`{}` imported torch but reported no include paths or no lib dir with libc10.so", self.exe)),
        }
    }
}

/// `p` without its last `n` components (`.../cu13/bin/nvcc`, 2 → `.../cu13`).
fn ancestor(p: &Path, n: usize) -> PathBuf {
    p.ancestors().nth(n).unwrap_or(p).to_path_buf()
}

/// CUDA toolkit paths.
struct Cuda {
    nvcc: PathBuf,
    include: PathBuf,
    lib_dir: PathBuf,
}

fn find_cuda(cuda_home: &Option<String>, py: &mut Python, cudart: &str) -> Result<Cuda, String> {
    let home = match cuda_home {
        Some(h) => PathBuf::from(h),
        None => py
            .find_in_site("nvidia/cu13/bin/nvcc")
            .map(|p| ancestor(&p, 2))
            .map_err(|e| format!("CUDA toolkit (features cuda/nccl): CUDA_HOME is unset and {e}"))?,
    };
    let nvcc = home.join("bin/nvcc");
    let include = home.join("include");
    if !nvcc.exists() || !include.join("cuda_runtime.h").exists() {
        return Err(format!("CUDA toolkit: {} has no bin/nvcc or include/cuda_runtime.h", home.display()));
    }
    let wanted = if cudart == "static" { "libcudart_static.a" } else { "libcudart.so" };
    let lib_dir = ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|d| home.join(d))
        .find(|d| cudart_in(d, cudart).is_some())
        .ok_or_else(|| format!("CUDA toolkit: no {wanted}* in {}/{{lib64,lib,targets/x86_64-linux/lib}}", home.display()))?;
    Ok(Cuda { nvcc, include, lib_dir })
}

/// The cudart library file name in `dir` for the link mode, if present.
fn cudart_in(dir: &Path, mode: &str) -> Option<String> {
    if mode == "static" {
        return dir.join("libcudart_static.a").exists().then(|| "libcudart_static.a".to_string());
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n == "libcudart.so" || (n.starts_with("libcudart.so.") && n.matches('.').count() == 2))
        .collect();
    names.sort();
    names.into_iter().next()
}

fn find_nccl(nccl_home: &Option<String>, py: &mut Python) -> Result<PathBuf, String> {
    let home = match nccl_home {
        Some(h) => PathBuf::from(h),
        None => py
            .find_in_site("nvidia/nccl/include/nccl.h")
            .map(|p| ancestor(&p, 2))
            .map_err(|e| format!("NCCL headers (features cuda/nccl): NCCL_HOME is unset and {e}"))?,
    };
    if !home.join("include/nccl.h").exists() {
        return Err(format!("NCCL: {} has no include/nccl.h", home.display()));
    }
    Ok(home)
}

/// What bindgen needs: a libclang to load and C builtin headers for it.
struct Clang {
    libclang_dir: PathBuf,
    source: &'static str,
    builtins: Option<PathBuf>,
}

/// libclang for bindgen: `LIBCLANG_PATH`, else the PyPI `libclang` wheel of the build's python
/// (`clang/native/libclang.so`), so that no system package and no root is needed. Its builtin
/// headers come from the C compiler (`-print-file-name=include`), the wheel ships none.
fn find_clang(libclang_path: &Option<String>, builtins: Option<String>, py: &mut Python) -> Result<Clang, String> {
    let (libclang_dir, source) = match libclang_path {
        Some(d) => (PathBuf::from(d), "LIBCLANG_PATH"),
        None => {
            let so = py.find_in_site("clang/native/libclang.so").map_err(|e| {
                format!(
                    "libclang for bindgen (features cuda/nccl): LIBCLANG_PATH is unset and {e}; `pip install libclang` into that python"
                )
            })?;
            (ancestor(&so, 1), "the PyPI libclang wheel")
        }
    };
    let has_lib = std::fs::read_dir(&libclang_dir)
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).any(|n| n.starts_with("libclang") && n.contains(".so")))
        .unwrap_or(false);
    if !has_lib {
        return Err(format!("libclang for bindgen: {} (from {source}) has no libclang*.so*", libclang_dir.display()));
    }
    let builtins = match builtins {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            let cc = env::var("CC").ok().filter(|c| !c.trim().is_empty()).unwrap_or_else(|| "gcc".into());
            Command::new(&cc)
                .arg("-print-file-name=include")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
                .filter(|p| p.join("stddef.h").exists())
        }
    };
    Ok(Clang { libclang_dir, source, builtins })
}

fn find_torch(libtorch: &Option<String>, py: &Python) -> Result<Torch, String> {
    match libtorch {
        Some(dir) => {
            let d = PathBuf::from(dir);
            if !d.join("include/torch/library.h").exists() || !d.join("lib/libc10.so").exists() {
                return Err(format!("libtorch (feature torch): LIBTORCH={dir} has no include/torch/library.h or lib/libc10.so"));
            }
            let include = vec![d.join("include"), d.join("include/torch/csrc/api/include")];
            Ok(Torch { source: format!("LIBTORCH={dir}"), cxx11_abi: true, include, lib_dir: d.join("lib") })
        }
        None => py.torch().map_err(|e| format!("libtorch (feature torch): LIBTORCH is unset and {e}")),
    }
}

/// Files in `dir` with extension `ext`, sorted (empty if the directory does not exist).
fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == ext)).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Parses `DEEP_EP_CUDA_ARCHS` ("90,100", "90a") into SM names.
fn parse_archs(spec: &str) -> Result<Vec<String>, String> {
    let archs: Vec<String> = spec.split(',').map(|s| s.trim().trim_start_matches("sm_").to_string()).filter(|s| !s.is_empty()).collect();
    // Digits with an optional arch-specific (`a`) or family (`f`) suffix: 90, 90a, 100f.
    let ok = |a: &String| {
        let digits = a.trim_end_matches(['a', 'f']);
        digits.len() >= 2 && a.len() - digits.len() <= 1 && digits.chars().all(|c| c.is_ascii_digit())
    };
    if archs.is_empty() || !archs.iter().all(ok) {
        return Err(format!("DEEP_EP_CUDA_ARCHS={spec:?} is not a comma list of SM numbers such as 90 or 90,100"));
    }
    Ok(archs)
}

/// Stops the build with every problem and every knob in one message.
fn fail(problems: &[String], py: &Python) -> ! {
    eprintln!("\ndeep_ep build script: cannot build the native parts.\n");
    for p in problems {
        eprintln!("  - {p}");
    }
    eprintln!("\nKnobs (environment variables), python = {}:", py.describe());
    for (name, what) in KNOBS {
        let val = env::var(name).unwrap_or_else(|_| "<unset>".into());
        eprintln!("  {name:<22} = {val}\n  {:<22}   {what}", "");
    }
    eprintln!(
        "\nFeatures: cuda (nvcc kernels), nccl (bindings, needs cuda), torch (operator shim). A pure-Rust\n\
         build needs none of the above: cargo build --no-default-features\n"
    );
    std::process::exit(1);
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    // Read every knob up front so each one is watched whatever the features are.
    let mut py = Python::new(knob("DEEP_EP_PYTHON"), knob("VIRTUAL_ENV"), &manifest.join(".venv"));
    let (libtorch, cuda_home, nccl_home) = (knob("LIBTORCH"), knob("CUDA_HOME"), knob("NCCL_HOME"));
    let archs_spec = knob("DEEP_EP_CUDA_ARCHS").unwrap_or_else(|| "90".into());
    let cudart = knob("DEEP_EP_CUDART").unwrap_or_else(|| "static".into());
    let nvshmem_home = knob("NVSHMEM_HOME");
    let (libclang_path, clang_builtins) = (knob("LIBCLANG_PATH"), knob("DEEP_EP_CLANG_BUILTINS"));
    println!("cargo:rustc-check-cfg=cfg(deep_ep_nvshmem_device)");
    let (want_cuda, want_nccl, want_torch) = (feature("cuda"), feature("nccl"), feature("torch"));

    let kernels_dir = manifest.join("kernels");
    let torch_dir = manifest.join("torch_ops");
    let shim_sources = if want_torch { files_with_ext(&torch_dir, "cpp") } else { vec![] };
    if want_torch && torch_dir.is_dir() {
        // A directory is scanned as a whole, so new .cpp files rerun this script too. (While the
        // directory does not exist nothing is watched: a missing path would rerun every build.)
        println!("cargo:rerun-if-changed={}", torch_dir.display());
    }
    if want_torch && shim_sources.is_empty() {
        println!("cargo:warning=feature `torch`: torch_ops/ has no .cpp files, building without the operator shim");
    }

    // Discover everything first, so one failure message can list every missing piece.
    let mut problems = Vec::new();
    let mut archs = vec![];
    let (mut cuda, mut nccl, mut torch) = (None, None, None);
    if want_cuda || want_nccl {
        if cudart != "static" && cudart != "shared" {
            problems.push(format!("DEEP_EP_CUDART={cudart:?}: expected static or shared"));
        }
        match parse_archs(&archs_spec) {
            Ok(a) => archs = a,
            Err(e) => problems.push(e),
        }
        match find_cuda(&cuda_home, &mut py, if cudart == "shared" { "shared" } else { "static" }) {
            Ok(c) => cuda = Some(c),
            Err(e) => problems.push(e),
        }
        match find_nccl(&nccl_home, &mut py) {
            Ok(n) => nccl = Some(n),
            Err(e) => problems.push(e),
        }
    }
    let mut clang = None;
    if want_cuda || want_nccl {
        match find_clang(&libclang_path, clang_builtins, &mut py) {
            Ok(c) => clang = Some(c),
            Err(e) => problems.push(e),
        }
    }
    if !shim_sources.is_empty() {
        match find_torch(&libtorch, &py) {
            Ok(t) => torch = Some(t),
            Err(e) => problems.push(e),
        }
    }
    if !problems.is_empty() {
        fail(&problems, &py);
    }

    if let (true, true, Some(c), Some(n)) = (want_cuda, feature("nvshmem"), &cuda, &nccl) {
        // The NVSHMEM device transport is optional: without NVSHMEM's device library the backend
        // still works (host-only NVSHMEM), only the NVSHMEM transport is missing. Built before the
        // kernels so that its archive precedes cudart on the link line.
        match find_nvshmem(&nvshmem_home, &mut py) {
            Ok(home) => match build_nvshmem_device(&kernels_dir, c, n, &home, &archs, &out_dir) {
                Ok(()) => println!("cargo:rustc-cfg=deep_ep_nvshmem_device"),
                Err(e) => fail(&[e], &py),
            },
            Err(e) => println!("cargo:warning=feature `nvshmem`: building without the NVSHMEM device transport: {e}"),
        }
    }
    if let (true, Some(c), Some(n), Some(cl)) = (want_cuda, &cuda, &nccl, &clang) {
        if let Err(e) = build_kernels(&kernels_dir, c, n, &archs, &cudart).and_then(|()| kernel_bindings(&kernels_dir, cl, &out_dir)) {
            fail(&[e], &py);
        }
    }
    if let (true, Some(c), Some(n), Some(cl)) = (want_nccl, &cuda, &nccl, &clang) {
        if let Err(e) = nccl_bindings(n, c, cl, &out_dir) {
            fail(&[e], &py);
        }
    }
    if let Some(t) = &torch {
        if let Err(e) = build_shim(&manifest, &shim_sources, t, cuda.as_ref().filter(|_| want_cuda), &out_dir) {
            fail(&[e], &py);
        }
    }
    if feature("nvshmem") {
        // Tests only: the wheel's libnvshmem_host.so.3, when the build's python has one. The
        // feature itself needs nothing at build time (src/ffi/nvshmem.rs declares the symbols).
        if let Ok(p) = py.find_in_site("nvidia/nvshmem/lib/libnvshmem_host.so.3") {
            println!("cargo:rustc-env=DEEP_EP_BUILD_NVSHMEM_HOME={}", ancestor(&p, 2).display());
        }
    }
    // Reported by `deep_ep::build_info` (src/build_info.rs).
    println!("cargo:rustc-env=DEEP_EP_BUILD_CUDA_ARCHS={}", if want_cuda { archs.join(",") } else { String::new() });
    println!("cargo:rustc-env=DEEP_EP_BUILD_CUDART={}", if want_cuda { cudart.as_str() } else { "" });
    println!("cargo:rustc-env=DEEP_EP_BUILD_TORCH={}", torch.as_ref().map_or(String::new(), |t| t.source.clone()));
}

/// Compiles `kernels/*.cu` with nvcc into `libdeep_ep_kernels.a` and links cudart.
fn build_kernels(dir: &Path, cuda: &Cuda, nccl_home: &Path, archs: &[String], cudart: &str) -> Result<(), String> {
    let sources = files_with_ext(dir, "cu");
    println!("cargo:rerun-if-changed={}", dir.display());
    for f in sources.iter().chain(&files_with_ext(dir, "cuh")).chain(&files_with_ext(dir, "h")) {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    if sources.is_empty() {
        return Err(format!("feature cuda: no .cu files in {}", dir.display()));
    }
    // cc finds nvcc only through NVCC or PATH (not `.compiler()`).
    env::set_var("NVCC", &cuda.nvcc);
    let mut b = cc::Build::new();
    b.cuda(true)
        .cudart("none") // linked below: cc's search path (<nvcc>/../targets/..) is absent in the pip wheel
        .debug(false) // cc would add `nvcc -G` (unoptimised device code) whenever DEBUG is set
        .flag("-std=c++17")
        .flag("-lineinfo")
        .flag("-Xcompiler")
        .flag("-fPIC")
        // Host code of kernels/logfmt.cuh must round every f32 operation on its own, as the
        // device intrinsics do (no fused multiply-adds the source did not write).
        .flag("-Xcompiler")
        .flag("-ffp-contract=off")
        .include(dir)
        .include(nccl_home.join("include"));
    for a in archs {
        b.flag("-gencode").flag(format!("arch=compute_{a},code=sm_{a}"));
    }
    if feature("rank-stride-test") {
        // Loops over ranks and nodes run on one warp (docs/RANKS.md), so few ranks take many turns.
        b.define("DEEP_EP_TEST_RANK_STRIDE", "1");
    }
    if feature("ll-stamps") {
        b.define("DEEP_EP_LL_STAMPS", "1");
    }
    b.files(&sources).try_compile("deep_ep_kernels").map_err(|e| format!("nvcc failed on kernels/*.cu: {e}"))?;

    println!("cargo:rustc-link-search=native={}", cuda.lib_dir.display());
    if cudart == "shared" {
        match cudart_in(&cuda.lib_dir, "shared").as_deref() {
            Some("libcudart.so") => println!("cargo:rustc-link-lib=dylib=cudart"),
            Some(versioned) => println!("cargo:rustc-link-lib=dylib:+verbatim={versioned}"),
            None => return Err(format!("no libcudart.so* in {}", cuda.lib_dir.display())),
        }
    } else {
        for lib in ["cudart_static", "dl", "rt", "pthread"] {
            println!("cargo:rustc-link-lib={lib}");
        }
    }
    Ok(())
}

/// NVSHMEM's home (headers and static device library): `NVSHMEM_HOME`, else the pip wheel.
fn find_nvshmem(nvshmem_home: &Option<String>, py: &mut Python) -> Result<PathBuf, String> {
    let home = match nvshmem_home {
        Some(h) => PathBuf::from(h),
        None => py
            .find_in_site("nvidia/nvshmem/include/nvshmem.h")
            .map(|p| ancestor(&p, 2))
            .map_err(|e| format!("NVSHMEM_HOME is unset and {e}"))?,
    };
    if !home.join("include/nvshmem.h").exists() || !home.join("lib/libnvshmem_device.a").exists() {
        return Err(format!("{} has no include/nvshmem.h or lib/libnvshmem_device.a", home.display()));
    }
    Ok(home)
}

/// Runs `cmd`, turning a failure into the build's error message.
fn run_tool(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: could not run {:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!("{what} failed: {:?}\n{}{}", cmd, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Builds `kernels/nvshmem/*.cu`, the one unit that calls NVSHMEM's device API, into
/// `libdeep_ep_nvshmem.a`: compiled with relocatable device code, device-linked (nvcc -dlink)
/// against `libnvshmem_device.a`, and archived together with that library's host objects (the
/// device-link stub names their fatbin wrappers). Nothing else changes: the other kernels keep
/// their whole-program compilation, and the host library is still dlopen'ed at run time.
fn build_nvshmem_device(
    kernels: &Path,
    cuda: &Cuda,
    nccl_home: &Path,
    home: &Path,
    archs: &[String],
    out_dir: &Path,
) -> Result<(), String> {
    let dir = kernels.join("nvshmem");
    let sources = files_with_ext(&dir, "cu");
    for f in &sources {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let device_lib = home.join("lib/libnvshmem_device.a");
    println!("cargo:rerun-if-changed={}", device_lib.display());
    let work = out_dir.join("nvshmem_device");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| format!("cannot create {}: {e}", work.display()))?;
    let gencode: Vec<String> = archs.iter().flat_map(|a| ["-gencode".to_string(), format!("arch=compute_{a},code=sm_{a}")]).collect();
    let mut objects = vec![];
    for (i, src) in sources.iter().enumerate() {
        let obj = work.join(format!("unit{i}.o"));
        run_tool(
            Command::new(&cuda.nvcc)
                .args(["-std=c++17", "-O3", "-lineinfo", "-rdc=true", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off"])
                .args(&gencode)
                .arg("-I")
                .arg(kernels)
                .arg("-I")
                .arg(nccl_home.join("include"))
                .arg("-I")
                .arg(home.join("include"))
                .arg("-c")
                .arg(src)
                .arg("-o")
                .arg(&obj),
            &format!("nvcc -rdc on {}", src.display()),
        )?;
        objects.push(obj);
    }
    if objects.is_empty() {
        return Err(format!("feature nvshmem: no .cu files in {}", dir.display()));
    }
    let dlink = work.join("dlink.o");
    run_tool(
        Command::new(&cuda.nvcc)
            .args(["-dlink", "-Xcompiler", "-fPIC"])
            .args(&gencode)
            .args(&objects)
            .arg(&device_lib)
            .arg("-o")
            .arg(&dlink),
        "nvcc -dlink against libnvshmem_device.a",
    )?;
    objects.push(dlink);
    // The static library's host objects, extracted so that one archive holds everything (a
    // single archive is rescanned by the linker, so member order does not matter).
    let members = work.join("members");
    std::fs::create_dir_all(&members).map_err(|e| format!("cannot create {}: {e}", members.display()))?;
    let ar = cc::Build::new().get_archiver();
    let ar_prog = ar.get_program().to_owned();
    run_tool(Command::new(&ar_prog).current_dir(&members).arg("x").arg(&device_lib), "ar x libnvshmem_device.a")?;
    objects.extend(files_with_ext(&members, "o"));
    let archive = out_dir.join("libdeep_ep_nvshmem.a");
    let _ = std::fs::remove_file(&archive);
    run_tool(Command::new(&ar_prog).arg("crs").arg(&archive).args(&objects), "ar crs libdeep_ep_nvshmem.a")?;
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=deep_ep_nvshmem");
    Ok(())
}

/// Generates the Rust declarations of the kernels' C launch API (`kernels/deep_ep_kernels.h` and
/// the `transport_api.h` and `logfmt_api.h` it includes: argument structs, launchers, constants) into
/// `$OUT_DIR/kernels_sys.rs`, included by `src/sys/kernels.rs`: one source for both languages.
#[cfg(feature = "cuda")]
fn kernel_bindings(kernels_dir: &Path, clang: &Clang, out_dir: &Path) -> Result<(), String> {
    // clang-sys (bindgen's loader) reads LIBCLANG_PATH when bindgen first runs, in this process.
    env::set_var("LIBCLANG_PATH", &clang.libclang_dir);
    let header = kernels_dir.join("deep_ep_kernels.h");
    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_arg(format!("-I{}", kernels_dir.display()))
        .clang_args(clang.builtins.iter().flat_map(|d| ["-idirafter".to_string(), d.display().to_string()]))
        .allowlist_function("dek_.*")
        .allowlist_type("dek_.*")
        .allowlist_var("DEK_.*")
        .derive_default(true)
        .derive_debug(true)
        .derive_partialeq(true)
        .derive_eq(true)
        .generate()
        .map_err(|e| {
            format!("bindgen failed on {} with the libclang of {} ({}): {e}", header.display(), clang.libclang_dir.display(), clang.source)
        })?;
    let dest = out_dir.join("kernels_sys.rs");
    bindings.write_to_file(&dest).map_err(|e| format!("cannot write {}: {e}", dest.display()))
}

#[cfg(not(feature = "cuda"))]
fn kernel_bindings(_: &Path, _: &Clang, _: &Path) -> Result<(), String> {
    Ok(())
}

/// Generates dynamic-loading NCCL bindings (`NcclLib`) into `$OUT_DIR/nccl_bindings.rs`.
#[cfg(feature = "nccl")]
fn nccl_bindings(nccl_home: &Path, cuda: &Cuda, clang: &Clang, out_dir: &Path) -> Result<(), String> {
    // clang-sys (bindgen's loader) reads LIBCLANG_PATH when bindgen first runs, in this process.
    env::set_var("LIBCLANG_PATH", &clang.libclang_dir);
    let header = nccl_home.join("include/nccl.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let text = std::fs::read_to_string(&header).map_err(|e| format!("cannot read {}: {e}", header.display()))?;
    let code = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("#define NCCL_VERSION_CODE").map(|v| v.trim().parse::<i32>()))
        .and_then(|r| r.ok())
        .ok_or_else(|| format!("{} has no numeric `#define NCCL_VERSION_CODE`", header.display()))?;
    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_arg(format!("-I{}", nccl_home.join("include").display()))
        .clang_arg(format!("-I{}", cuda.include.display()))
        // The PyPI libclang has no builtin headers of its own; gcc's serve (stddef.h, stdint.h).
        .clang_args(clang.builtins.iter().flat_map(|d| ["-idirafter".to_string(), d.display().to_string()]))
        .allowlist_function("nccl.*")
        .allowlist_type("nccl.*")
        .allowlist_var("nccl.*|NCCL_.*")
        // Streams cross as opaque pointers (torch hands us a raw cudaStream_t).
        .blocklist_type("cudaStream_t")
        .raw_line("pub type cudaStream_t = *mut ::std::os::raw::c_void;")
        // Newtype enums: an unexpected value from the library is a number, not undefined behaviour.
        .default_enum_style(bindgen::EnumVariation::NewType { is_bitfield: false, is_global: false })
        .derive_default(true)
        .dynamic_library_name("NcclLib")
        // Missing symbols become `Err` fields instead of failing the whole load.
        .dynamic_link_require_all(false)
        .generate()
        .map_err(|e| {
            format!("bindgen failed on {} with the libclang of {} ({}): {e}", header.display(), clang.libclang_dir.display(), clang.source)
        })?;
    let mut src = bindings.to_string();
    src.push_str(&format!(
        "\n/// `NCCL_VERSION_CODE` of the headers these bindings were generated from.\npub const NCCL_HEADER_VERSION_CODE: i32 = {code};\n"
    ));
    let dest = out_dir.join("nccl_bindings.rs");
    std::fs::write(&dest, src).map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
    // Lets the unit tests find the libnccl.so.2 that matches the headers (tests only).
    println!("cargo:rustc-env=DEEP_EP_BUILD_NCCL_HOME={}", nccl_home.display());
    Ok(())
}

#[cfg(not(feature = "nccl"))]
fn nccl_bindings(_: &Path, _: &Cuda, _: &Clang, _: &Path) -> Result<(), String> {
    Ok(())
}

/// Compiles `torch_ops/*.cpp` into a static archive linked whole into the cdylib only.
fn build_shim(manifest: &Path, sources: &[PathBuf], torch: &Torch, cuda: Option<&Cuda>, out_dir: &Path) -> Result<(), String> {
    let (ops_dir, csrc) = (manifest.join("torch_ops"), manifest.join("csrc"));
    if csrc.is_dir() {
        println!("cargo:rerun-if-changed={}", csrc.display());
    }
    let mut b = cc::Build::new();
    b.cpp(true)
        .pic(true)
        .cargo_metadata(false) // no rustc-link-lib: the archive must reach the cdylib only, whole
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={}", u8::from(torch.cxx11_abi)))
        // libtorch's stable ABI, 2.10 surface: the shim then loads into any torch >= 2.10.
        .define("TORCH_TARGET_VERSION", "0x020a000000000000")
        .include(&ops_dir)
        .include(&csrc);
    // -isystem keeps libtorch's own warnings out of the build log.
    for inc in &torch.include {
        b.flag("-isystem").flag(inc.display().to_string());
    }
    if let Some(c) = cuda {
        b.define("USE_CUDA", None).flag("-isystem").flag(c.include.display().to_string());
    }
    b.files(sources).try_compile("deep_ep_torch").map_err(|e| format!("g++ failed on torch_ops/*.cpp ({}): {e}", torch.source))?;

    let archive = out_dir.join("libdeep_ep_torch.a");
    let lib = torch.lib_dir.display();
    let mut args = vec!["-Wl,--whole-archive".to_string(), archive.display().to_string(), "-Wl,--no-whole-archive".into()];
    args.push(format!("-L{lib}"));
    // The stable C shim lives in libtorch_cpu; its CUDA half (current stream) is looked up at run
    // time (torch_ops/common.h), so a CPU-only torch can load the same file.
    args.push("-ltorch_cpu".into());
    // Resolves libtorch when the .so sits in site-packages/<pkg>/ next to torch/ (harmless otherwise).
    args.extend(["-lstdc++".into(), "-Wl,-rpath,$ORIGIN/../torch/lib".into()]);
    for a in args {
        println!("cargo:rustc-cdylib-link-arg={a}");
    }
    Ok(())
}
