//! The shared memory of a buffer for the ranks of one machine (a CPU buffer, the ipc provider's
//! host rendezvous). By default anonymous: rank 0 makes a memfd (memory with no name in any
//! folder, freed with its last mapping) and hands its descriptor to every other rank over an
//! abstract Unix socket named after the unique id (no file either; the name goes when rank 0
//! closes it or dies). Whoever is killed, whenever, nothing is left behind, and the size of `/dev/shm` (64 MB
//! in a default Docker container) does not matter: the memory counts against the machine's (or
//! the container's) memory instead. Ranks must share a network namespace (any processes of one
//! host or container do); `DEEP_EP_SHM_DIR` selects named files in a folder instead.

use super::{self as shm, Segment};
use crate::error::{Error, Result, WaitEnd};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// 128 random bits (time and pid where `getrandom` fails: uniqueness per machine is all a
/// rendezvous name needs).
pub fn random_u128() -> u128 {
    let mut rnd = [0u8; 16];
    // SAFETY: getrandom writes at most len bytes into the buffer.
    let got = unsafe { libc::getrandom(rnd.as_mut_ptr().cast(), rnd.len(), 0) };
    if got != rnd.len() as isize {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        return t ^ ((std::process::id() as u128) << 64);
    }
    u128::from_le_bytes(rnd)
}

/// A fresh rendezvous id of the `kind` backend (`cpu`, `ipc`): `deep_ep_<kind>:` and a random hex
/// name, zero-padded to [`crate::config::UNIQUE_ID_BYTES`].
pub fn make_unique_id(kind: &str) -> Vec<u8> {
    let mut id = format!("deep_ep_{kind}:").into_bytes();
    id.extend(random_u128().to_le_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>().bytes());
    id.resize(crate::config::UNIQUE_ID_BYTES, 0);
    id
}

/// The rendezvous name (`<kind>_<hex>`) of an id that [`make_unique_id`] made for `kind`.
pub fn name_from_id(op: &'static str, kind: &str, id: &[u8]) -> Result<String> {
    let prefix = format!("deep_ep_{kind}:");
    let end = id.iter().position(|&b| b == 0).unwrap_or(id.len());
    let body = &id[..end];
    if !body.starts_with(prefix.as_bytes()) || body.len() == prefix.len() {
        return Err(Error::invalid(op, format!("unique_id was not made by get_unique_id('{kind}')")));
    }
    let name = std::str::from_utf8(&body[prefix.len()..])
        .ok()
        .filter(|s| s.bytes().all(|b| b.is_ascii_alphanumeric()))
        .ok_or_else(|| Error::invalid(op, "unique_id holds an invalid name"))?;
    Ok(format!("{kind}_{name}"))
}

/// First word of a request: a stray connection (another program, an old version) is dropped.
const MAGIC: u32 = 0xDEE9_0001;
/// How long rank 0 waits for one connected rank's request before dropping it.
const REQUEST_WAIT: Duration = Duration::from_secs(1);

/// Collective over the ranks of one machine: a mapping of `len` shared bytes for the buffer named
/// `name` (the unique id's alphanumeric part, with a prefix per kind of buffer). Anonymous
/// memory by default (nothing in any folder, whatever dies when); with
/// `DEEP_EP_SHM_DIR` set, a named file in that folder that every rank opens (for ranks that do not
/// share a network namespace), removed by the caller once every rank has mapped it.
pub fn segment(op: &'static str, name: &str, rank: usize, num_ranks: usize, len: usize, timeout: Duration) -> Result<Segment> {
    match crate::settings::shm_dir_checked(op)? {
        None => rendezvous(op, name, rank, num_ranks, len, timeout),
        Some(dir) => {
            // Never younger than twice the default deadline: another job on the machine may wait longer.
            remove_stale_files(&dir, 2 * timeout.max(Duration::from_millis(crate::settings::DEFAULT_TIMEOUT_MS)));
            Segment::open(op, &format!("{dir}/deep_ep_{name}"), len).map_err(|e| match e {
                Error::Os { op, what, source } => Error::Os { op, what: format!("{what} (in DEEP_EP_SHM_DIR={dir:?})"), source },
                e => e,
            })
        }
    }
}

/// Whether `file` is a name [`segment`] gives a file: `deep_ep_<kind>_<32 hex digits>`, the
/// kind in lowercase letters and the digits of an id [`make_unique_id`] made.
fn is_own_file_name(file: &str) -> bool {
    let Some((kind, hex)) = file.strip_prefix("deep_ep_").and_then(|rest| rest.split_once('_')) else { return false };
    !kind.is_empty()
        && kind.bytes().all(|b| b.is_ascii_lowercase())
        && hex.len() == 32
        && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Removes the library's files in `dir` not modified for `age`: named as [`segment`] names
/// them and starting with its header ([`shm::is_own_file`]); anything else, whatever its name,
/// is the user's and stays. A file exists only while its buffer is being created (every rank
/// removes the name once all have mapped it), and creation gives up after the timeout, so such
/// a file was left by ranks killed during creation (SIGKILL, SIGTERM in the rendezvous). Called
/// at every creation; errors are ignored.
pub fn remove_stale_files(dir: &str, age: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let now = std::time::SystemTime::now();
    for e in entries.flatten() {
        let stale = e.file_name().to_str().is_some_and(is_own_file_name)
            && e.metadata().ok().and_then(|m| m.modified().ok()).and_then(|t| now.duration_since(t).ok()).is_some_and(|d| d > age)
            && shm::is_own_file(&e.path());
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn os_err(op: &'static str, what: String) -> Error {
    Error::Os { op, what, source: std::io::Error::last_os_error() }
}

/// The abstract address `\0deep_ep/<name>` (`name` is the unique id's alphanumeric part).
fn address(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let full = format!("deep_ep/{name}");
    let n = full.len().min(a.sun_path.len() - 1);
    for (d, s) in a.sun_path[1..=n].iter_mut().zip(full.bytes()) {
        *d = s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + n;
    (a, len as libc::socklen_t)
}

fn socket(op: &'static str) -> Result<OwnedFd> {
    // SAFETY: plain libc call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(os_err(op, "socket(AF_UNIX)".into()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn set_timeouts(fd: &OwnedFd, t: Duration) {
    let t = t.max(Duration::from_millis(1));
    let tv = libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as libc::suseconds_t };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: valid socket and option buffer; failure only leaves the socket blocking.
        unsafe {
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, opt, &tv as *const _ as *const libc::c_void, std::mem::size_of_val(&tv) as _)
        };
    }
}

/// Makes the memory of a buffer: `len` bytes reserved now (not at first touch, where a full
/// machine would kill the process with SIGBUS instead of raising here).
fn make_memory(op: &'static str, name: &str, len: usize) -> Result<OwnedFd> {
    let cname = CString::new(format!("deep_ep_{name}")).map_err(|_| Error::invalid(op, "shared-memory name contains NUL"))?;
    // SAFETY: NUL-terminated name; the descriptor is owned at once.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(os_err(op, "memfd_create".into()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let reserve_err = |source: std::io::Error| Error::Os {
        op,
        what: format!(
            "cannot reserve {len} bytes ({:.1} MiB) of shared memory for the buffer (anonymous memory): the machine or the \
             container's memory limit has no room; make the buffer smaller or free memory",
            len as f64 / (1u64 << 20) as f64
        ),
        source,
    };
    // SAFETY: valid descriptor. A size over RLIMIT_FSIZE would also raise SIGXFSZ (default: the
    // process dies); callers that set such a limit ignore the signal and get EFBIG here.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(reserve_err(std::io::Error::last_os_error()));
    }
    // SAFETY: valid descriptor and range.
    let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, len as libc::off_t) };
    if rc != 0 {
        return Err(reserve_err(std::io::Error::from_raw_os_error(rc)));
    }
    Ok(fd)
}

/// Collective over the `num_ranks` ranks (processes or threads) of one machine: rank 0 makes
/// `len` bytes and every rank returns a mapping of them. Every wait ends by `timeout`, naming
/// the ranks that never came (at rank 0) or rank 0 (elsewhere). A rank that maps memory of
/// another size (it asked for another buffer) gets rank 0's size; the caller's record check
/// reports the difference.
pub fn rendezvous(op: &'static str, name: &str, rank: usize, num_ranks: usize, len: usize, timeout: Duration) -> Result<Segment> {
    if rank == 0 {
        serve(op, name, num_ranks, len, timeout)
    } else {
        receive(op, name, rank, timeout)
    }
}

fn serve(op: &'static str, name: &str, num_ranks: usize, len: usize, timeout: Duration) -> Result<Segment> {
    let mem = make_memory(op, name, len)?;
    let seg = shm::map_fd(op, &mem, len, "anonymous buffer memory")?;
    if num_ranks == 1 {
        return Ok(seg);
    }
    let sock = socket(op)?;
    let (addr, addr_len) = address(name);
    // SAFETY: valid socket and address.
    if unsafe { libc::bind(sock.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, addr_len) } != 0 {
        let e = std::io::Error::last_os_error();
        let what = if e.raw_os_error() == Some(libc::EADDRINUSE) {
            "another buffer is being created from this unique_id right now (every Buffer needs its own get_unique_id)".to_string()
        } else {
            format!("bind the abstract socket deep_ep/{name}")
        };
        return Err(Error::Os { op, what, source: e });
    }
    // SAFETY: valid, bound socket.
    if unsafe { libc::listen(sock.as_raw_fd(), num_ranks.min(4096) as i32) } != 0 {
        return Err(os_err(op, "listen".into()));
    }
    let start = Instant::now();
    let mut checked = start;
    let mut served = vec![false; num_ranks];
    served[0] = true;
    while served.iter().any(|s| !s) {
        let left = timeout.saturating_sub(start.elapsed());
        let end = if left.is_zero() {
            Some(WaitEnd::TimedOut)
        } else {
            crate::interrupt::requested_during(&mut checked).then_some(WaitEnd::Interrupted)
        };
        if let Some(end) = end {
            let missing = (0..num_ranks).filter(|&p| !served[p]).collect();
            let what = "rendezvous: handing the buffer memory to every rank".to_string();
            return Err(Error::wait_ended(end, op, 0, missing, timeout.as_millis() as u64, what));
        }
        let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, left.as_millis().clamp(1, 100) as i32) } <= 0 {
            continue; // timeout or EINTR: the loop rechecks the deadline
        }
        // SAFETY: valid listening socket; the descriptor is owned at once.
        let c = unsafe { libc::accept4(sock.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC) };
        if c < 0 {
            continue;
        }
        // SAFETY: fresh descriptor nobody else owns.
        let conn = unsafe { OwnedFd::from_raw_fd(c) };
        if let Some(r) = hand_over(&conn, &mem, len) {
            if r < num_ranks {
                served[r] = true;
            }
        }
    }
    Ok(seg) // the listening socket closes here: the name is gone; `mem` closes, the mappings stay
}

/// Answers one request `[MAGIC u32, rank u32]` with the memory's descriptor and its length;
/// returns the rank served, or `None` for a stray or silent connection.
fn hand_over(conn: &OwnedFd, mem: &OwnedFd, len: usize) -> Option<usize> {
    set_timeouts(conn, REQUEST_WAIT);
    let mut req = [0u8; 8];
    // SAFETY: valid socket and buffer; MSG_WAITALL reads the whole request or fails.
    let n = unsafe { libc::recv(conn.as_raw_fd(), req.as_mut_ptr() as *mut libc::c_void, 8, libc::MSG_WAITALL) };
    if n != 8 || u32::from_le_bytes(req[..4].try_into().unwrap()) != MAGIC {
        return None;
    }
    let rank = u32::from_le_bytes(req[4..].try_into().unwrap()) as usize;
    let payload = (len as u64).to_le_bytes();
    send_fd(conn, mem, &payload).then_some(rank)
}

/// Room for one control message carrying one descriptor (`SCM_RIGHTS`).
fn fd_control() -> Vec<u8> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    vec![0u8; unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize]
}

/// A message of one buffer (`iov`) and the control area `control`; both must outlive its use.
fn fd_msghdr(iov: &mut libc::iovec, control: &mut [u8]) -> libc::msghdr {
    // SAFETY: msghdr is plain data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = control.len() as _;
    msg
}

fn send_fd(conn: &OwnedFd, fd: &OwnedFd, payload: &[u8; 8]) -> bool {
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut libc::c_void, iov_len: payload.len() };
    let mut control = fd_control();
    let msg = fd_msghdr(&mut iov, &mut control);
    // SAFETY: the control buffer has room for one SCM_RIGHTS header with one int.
    unsafe {
        let cm = libc::CMSG_FIRSTHDR(&msg);
        (*cm).cmsg_level = libc::SOL_SOCKET;
        (*cm).cmsg_type = libc::SCM_RIGHTS;
        (*cm).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cm) as *mut libc::c_int, fd.as_raw_fd());
        libc::sendmsg(conn.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) == payload.len() as isize
    }
}

fn receive(op: &'static str, name: &str, rank: usize, timeout: Duration) -> Result<Segment> {
    let start = Instant::now();
    let mut checked = start;
    let (addr, addr_len) = address(name);
    // Every wait below (rank 0 not listening yet, or not answering) ends by the deadline or
    // Ctrl-C, as every other host wait does.
    let ended = |checked: &mut Instant| {
        if start.elapsed() >= timeout {
            Some(WaitEnd::TimedOut)
        } else {
            crate::interrupt::requested_during(checked).then_some(WaitEnd::Interrupted)
        }
    };
    let error = |end| {
        let what = "rendezvous: receiving the buffer memory from rank 0".to_string();
        Error::wait_ended(end, op, rank, vec![0], timeout.as_millis() as u64, what)
    };
    loop {
        let sock = socket(op)?;
        // SAFETY: valid socket and address.
        let connected = unsafe { libc::connect(sock.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, addr_len) } == 0;
        if connected {
            set_timeouts(&sock, timeout.saturating_sub(start.elapsed()));
            let mut req = [0u8; 8];
            req[..4].copy_from_slice(&MAGIC.to_le_bytes());
            req[4..].copy_from_slice(&(rank as u32).to_le_bytes());
            // SAFETY: valid socket and buffer.
            let sent = unsafe { libc::send(sock.as_raw_fd(), req.as_ptr() as *const libc::c_void, 8, libc::MSG_NOSIGNAL) } == 8;
            if sent {
                // Rank 0 answers at once; wait for it in slices so that Ctrl-C is seen meanwhile.
                loop {
                    if let Some(end) = ended(&mut checked) {
                        return Err(error(end));
                    }
                    let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd.
                    let n = unsafe { libc::poll(&mut pfd, 1, crate::interrupt::CHECK_EVERY.as_millis() as i32) };
                    if n > 0 {
                        break;
                    }
                    if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                        break; // recvmsg below reports the connection's state
                    }
                }
                if let Some((fd, len)) = recv_fd(op, rank, &sock)? {
                    return shm::map_fd(op, &fd, len, "anonymous buffer memory from rank 0");
                }
            }
        }
        // Rank 0 not listening yet (or gone): try again until the deadline.
        if let Some(end) = ended(&mut checked) {
            return Err(error(end));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Receives rank 0's answer: the memory's descriptor and its length; `None` for a connection
/// that ended without one (try again). A descriptor the kernel could not give this process
/// (`MSG_CTRUNC`: no free descriptor) is an error here, on the rank that lacks it, instead of a
/// timeout that would blame rank 0.
fn recv_fd(op: &'static str, rank: usize, conn: &OwnedFd) -> Result<Option<(OwnedFd, usize)>> {
    let mut payload = [0u8; 8];
    let mut iov = libc::iovec { iov_base: payload.as_mut_ptr() as *mut libc::c_void, iov_len: 8 };
    let mut control = fd_control();
    let mut msg = fd_msghdr(&mut iov, &mut control);
    // SAFETY: valid socket; MSG_CMSG_CLOEXEC keeps the received descriptor out of exec'd children.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_WAITALL | libc::MSG_CMSG_CLOEXEC) };
    if n != 8 {
        return Ok(None);
    }
    // SAFETY: the kernel filled msg; the header is checked before its data is read.
    let fd = unsafe {
        let cm = libc::CMSG_FIRSTHDR(&msg);
        if cm.is_null() || (*cm).cmsg_level != libc::SOL_SOCKET || (*cm).cmsg_type != libc::SCM_RIGHTS {
            None
        } else {
            Some(OwnedFd::from_raw_fd(std::ptr::read_unaligned(libc::CMSG_DATA(cm) as *const libc::c_int)))
        }
    };
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // A descriptor that did arrive despite the truncation is closed by dropping it.
        drop(fd);
        // SAFETY: getrlimit fills the struct it is given.
        let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
        let limit = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur.to_string() } else { "?".into() };
        return Err(Error::Os {
            op,
            what: format!(
                "rank {rank} could not receive the buffer memory from rank 0: the kernel dropped its file descriptor \
                 (MSG_CTRUNC) because this process has no free file descriptor (open files limit {limit}, `ulimit -n`); \
                 raise the limit or close files"
            ),
            source: std::io::Error::from_raw_os_error(libc::EMFILE),
        });
    }
    Ok(fd.map(|fd| (fd, u64::from_le_bytes(payload) as usize)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(kind: &str) -> String {
        format!("deep_ep_{}", name_from_id("test", kind, &make_unique_id(kind)).unwrap())
    }

    #[test]
    fn own_file_names_are_exactly_the_ones_segment_makes() {
        assert!(is_own_file_name(&file_of("cpu")) && is_own_file_name(&file_of("ipc")));
        let hex = "0123456789abcdef".repeat(2);
        for other in [
            "deep_ep_notes.txt".to_string(),
            "deep_ep_".to_string(),
            format!("deep_ep__{hex}"),
            format!("deep_ep_cpu_{}", &hex[1..]),
            format!("deep_ep_cpu_{hex}0"),
            format!("deep_ep_cpu_{}", hex.to_uppercase()),
            format!("deep_ep_cpu_{hex}.bak"),
            format!("deep_ep_Cpu_{hex}"),
            format!("xdeep_ep_cpu_{hex}"),
        ] {
            assert!(!is_own_file_name(&other), "{other}");
        }
    }

    #[test]
    fn stale_files_removed_are_only_the_librarys_own() {
        let dir = std::env::temp_dir().join(format!("deep_ep_stale_test_{:x}", random_u128()));
        std::fs::create_dir(&dir).unwrap();
        let d = dir.to_str().unwrap();
        let own = format!("{d}/{}", file_of("cpu"));
        Segment::open("test", &own, 4096).unwrap(); // a file left behind by ranks killed in the rendezvous
        let lookalike = format!("{d}/{}", file_of("cpu")); // the name pattern, the user's content
        std::fs::write(&lookalike, b"user data").unwrap();
        let user = format!("{d}/deep_ep_notes.txt");
        std::fs::write(&user, b"notes").unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        for f in [&own, &lookalike, &user] {
            std::fs::File::options().write(true).open(f).unwrap().set_modified(old).unwrap();
        }
        remove_stale_files(d, Duration::from_secs(7200)); // younger than the age: all stay
        assert!([&own, &lookalike, &user].iter().all(|f| std::path::Path::new(f).exists()));
        remove_stale_files(d, Duration::from_secs(60));
        assert!(!std::path::Path::new(&own).exists());
        assert_eq!(std::fs::read(&lookalike).unwrap(), b"user data");
        assert_eq!(std::fs::read(&user).unwrap(), b"notes");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
